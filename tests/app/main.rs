//! `app()` with `oneshot`: the contract without a socket. The failure
//! modes on a broken store are in `failure_modes.rs`, the request timer
//! against the store's own bound in `timeouts.rs`.

mod failure_modes;
mod timeouts;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use ratelimiter::api::app;
use ratelimiter::clock::ManualClock;
use ratelimiter::config::Config;
use ratelimiter::middleware::Front;
use ratelimiter::server::{Stack, in_process_stack, state_with_stack};
use ratelimiter::store::MemoryStore;
use std::net::SocketAddr;
use std::sync::Arc;
use tower::ServiceExt;

const T0: u64 = 1_800_000_000_000_000;

/// The app on `stack`, configured by `toml`, at `T0` on a manual clock.
fn app_on(toml: &str, stack: impl FnOnce(&Config) -> Stack) -> Front {
    let config = Config::from_toml(toml).unwrap();
    let stack = stack(&config);
    app(state_with_stack(
        &config,
        stack,
        Arc::new(ManualClock::new(T0)),
    ))
}

/// The in-process stack.
fn in_memory(_: &Config) -> Stack {
    in_process_stack(MemoryStore::new(1000, 4))
}

fn example_app() -> Front {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml"))
        .unwrap();
    app_on(&text, in_memory)
}

fn request(method: &str, uri: &str, headers: &[(&str, &str)], body: Option<&str>) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    let mut r = b
        .body(body.map(|s| Body::from(s.to_owned())).unwrap_or_default())
        .unwrap();
    r.extensions_mut().insert(ConnectInfo(
        "192.0.2.10:5000".parse::<SocketAddr>().unwrap(),
    ));
    r
}

async fn send(app: &Front, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let r = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = r.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn operations_endpoints_are_never_limited() {
    let app = example_app();
    for path in ["/healthz", "/readyz", "/metrics"] {
        for _ in 0..30 {
            let (status, headers, _) = send(&app, request("GET", path, &[], None)).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            assert!(
                headers.get("ratelimit-limit").is_none(),
                "{path} carries limit headers"
            );
            assert_eq!(headers.get("x-instance-id").unwrap(), "api-1");
        }
    }
}

#[tokio::test]
async fn anonymous_clients_get_the_anonymous_limit_and_keys_their_own() {
    let app = example_app();
    let (status, headers, _) = send(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["ratelimit-limit"], "20");
    let (_, headers, _) = send(
        &app,
        request("GET", "/api/items/1", &[("x-api-key", "demo-key-a")], None),
    )
    .await;
    assert_eq!(headers["ratelimit-limit"], "100");
    // key_sha256-configured keys verify too; tenant-b has a limit of its
    // own on this policy (an override), and its fields say so.
    let (status, headers, _) = send(
        &app,
        request("GET", "/api/items/2", &[("x-api-key", "demo-key-b")], None),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["ratelimit-limit"], "1000");
    assert_eq!(headers["ratelimit-remaining"], "999");
    assert_eq!(headers["ratelimit-policy"], "\"api\";q=1000;w=2");
}

#[tokio::test]
async fn unknown_api_keys_are_limited_by_address_and_answered_401() {
    let app = example_app();
    let mut statuses = Vec::new();
    for i in 0..22 {
        let key = format!("guess-{i}");
        let (status, headers, body) = send(
            &app,
            request("GET", "/api/items", &[("x-api-key", &key)], None),
        )
        .await;
        if status == StatusCode::UNAUTHORIZED {
            assert_eq!(headers["content-type"], "application/problem+json");
            assert!(body.contains("unknown-api-key"));
            assert_eq!(headers["ratelimit-limit"], "20");
        }
        statuses.push(status.as_u16());
    }
    // Rotating guesses share the address's anonymous bucket of 20.
    assert_eq!(statuses, [vec![401; 20], vec![429; 2]].concat());
}

#[tokio::test]
async fn malformed_identity_headers_get_400_problem_json() {
    let app = example_app();
    let long = "x".repeat(300);
    for headers in [
        vec![("x-api-key", long.as_str())],
        vec![("x-api-key", "")],
        vec![
            ("x-api-key", "demo-key-a"),
            ("authorization", "Bearer demo-key-b"),
        ],
    ] {
        let (status, h, body) = send(&app, request("GET", "/api/items", &headers, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{headers:?}");
        assert_eq!(h["content-type"], "application/problem+json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], 400);
        assert!(v["detail"].as_str().unwrap().contains("API key"));
    }
}

#[tokio::test]
async fn per_route_policy_cost_and_unlimited_routes() {
    let app = example_app();
    let order = r#"{"item_id": 1, "quantity": 2}"#;
    let mut remaining = Vec::new();
    for _ in 0..6 {
        let (status, h, _) = send(
            &app,
            request(
                "POST",
                "/api/orders",
                &[("x-api-key", "demo-key-a")],
                Some(order),
            ),
        )
        .await;
        remaining.push((
            status.as_u16(),
            h["ratelimit-remaining"].to_str().unwrap().to_owned(),
        ));
        assert!(
            h["ratelimit-policy"]
                .to_str()
                .unwrap()
                .starts_with("\"orders\";q=10")
        );
    }
    // Burst 10 at cost 2: five orders, then 429.
    let expected: Vec<(u16, String)> = vec![
        (201, "8"),
        (201, "6"),
        (201, "4"),
        (201, "2"),
        (201, "0"),
        (429, "0"),
    ]
    .into_iter()
    .map(|(s, r)| (s, r.to_owned()))
    .collect();
    assert_eq!(remaining, expected);
    for _ in 0..50 {
        let (status, h, _) = send(&app, request("GET", "/api/status", &[], None)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(h.get("ratelimit-limit").is_none());
    }
}

#[tokio::test]
async fn sample_api_answers() {
    let app = example_app();
    let key = [("x-api-key", "demo-key-a")];
    let (status, _, body) = send(&app, request("GET", "/api/items", &key, None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("bucket"));
    let (status, h, _) = send(&app, request("GET", "/api/items/99", &key, None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(h["content-type"], "application/problem+json");
    let (status, _, _) = send(
        &app,
        request(
            "POST",
            "/api/orders",
            &key,
            Some(r#"{"item_id": 1, "quantity": 0}"#),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, _, body) = send(&app, request("GET", "/api/status", &[], None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("\"backend\":\"memory\""));
    // Unknown routes are 404, not limited.
    let (status, h, _) = send(&app, request("GET", "/api/nope", &key, None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(h.get("ratelimit-limit").is_none());
}

#[tokio::test]
async fn metrics_count_decisions_by_policy_and_outcome() {
    let app = example_app();
    for _ in 0..3 {
        send(
            &app,
            request("GET", "/api/items", &[("x-api-key", "demo-key-a")], None),
        )
        .await;
    }
    let (_, h, body) = send(&app, request("GET", "/metrics", &[], None)).await;
    assert!(
        h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let line = body
        .lines()
        .find(|l| {
            l.starts_with("ratelimit_decisions_total")
                && l.contains("key_kind=\"api_key\"")
                && l.contains("decision=\"allowed\"")
                && l.contains("policy=\"api\"")
        })
        .unwrap_or_else(|| panic!("no decisions counter in:\n{body}"));
    let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(value >= 3.0, "{line}");
    assert!(body.contains("ratelimit_check_duration_seconds_bucket"));
    // The exporter's text and the fixed buckets' together: no family twice.
    let mut families: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    let all = families.len();
    families.sort_unstable();
    families.dedup();
    assert_eq!(families.len(), all, "a family rendered twice in:\n{body}");
}

#[tokio::test]
async fn a_server_wired_without_peer_addresses_fails_loudly_not_open() {
    let app = example_app();
    let req = Request::builder()
        .uri("/api/items")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!body.contains("peer"), "internal detail leaked: {body}");
}

/// The in-process store runs the window algorithms too: a fixed window of
/// 10 per 10 s, started at a window's start, answers 429 until its end.
#[tokio::test]
async fn a_fixed_window_policy_runs_in_memory() {
    let app = app_on(
        "[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nalgorithm = \"fixed_window\"\n",
        in_memory,
    );
    assert_eq!(T0 % 10_000_000, 0, "T0 starts a window");
    for i in 0..10 {
        let (status, h, _) = send(&app, request("GET", "/api/items", &[], None)).await;
        assert_eq!(status, StatusCode::OK, "request {i}");
        assert_eq!(h["ratelimit-reset"], "10");
    }
    let (status, h, _) = send(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "10");
}

/// Every error a client can get is RFC 9457 problem+json with its status,
/// axum's own rejections included.
#[tokio::test]
async fn every_error_is_problem_json() {
    let app = example_app();
    let key = ("x-api-key", "demo-key-a");
    let json = ("content-type", "application/json");
    let big = format!(
        r#"{{"item_id": 1, "quantity": 1, "pad": "{}"}}"#,
        "x".repeat(3 << 20)
    );
    let cases: Vec<(Request<Body>, StatusCode)> = vec![
        // not JSON at all, by its content type
        (
            request("POST", "/api/orders", &[key], None),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        // JSON that does not parse
        (
            request("POST", "/api/orders", &[key], Some("{\"item_id\": ")),
            StatusCode::BAD_REQUEST,
        ),
        // JSON of the wrong shape
        (
            request("POST", "/api/orders", &[key], Some(r#"{"item_id": "one"}"#)),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        // larger than the body limit (2 MB)
        (
            request("POST", "/api/orders", &[key, json], Some(&big)),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
        // a path parameter that is not a number
        (
            request("GET", "/api/items/abc", &[key], None),
            StatusCode::BAD_REQUEST,
        ),
        // no such route
        (request("GET", "/nope", &[], None), StatusCode::NOT_FOUND),
        // a route without this method
        (
            request("DELETE", "/api/items", &[key], None),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (
            request("POST", "/healthz", &[], None),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
    ];
    for (req, expected) in cases {
        let what = format!("{} {}", req.method(), req.uri());
        let (status, h, body) = send(&app, req).await;
        assert_eq!(status, expected, "{what}: {body}");
        assert_eq!(h["content-type"], "application/problem+json", "{what}");
        let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(problem["status"], expected.as_u16(), "{what}: {body}");
        assert!(
            problem["type"].as_str().unwrap().starts_with("/problems/"),
            "{what}"
        );
        assert!(!problem["detail"].as_str().unwrap().is_empty(), "{what}");
        if expected == StatusCode::METHOD_NOT_ALLOWED {
            assert!(h.get("allow").is_some(), "{what}: 405 says what is allowed");
        }
    }
    // A rewritten 405 keeps its route for the telemetry layer: counted
    // under the template, not as `unmatched`.
    let (_, _, metrics) = send(&app, request("GET", "/metrics", &[], None)).await;
    let line = r#"http_server_request_duration_seconds_count{http_request_method="DELETE",http_route="/api/items",http_response_status_code="405"}"#;
    assert!(metrics.contains(line), "{line} missing");
}

/// A body without a declared length (chunked) is cut at `http.body_limit`
/// as it is read: 413 problem+json, and no order is placed.
#[tokio::test]
async fn a_streamed_body_over_the_limit_is_cut_as_it_is_read() {
    let app = app_on("[http]\nbody_limit = 64\n", in_memory);
    let order = |padding: usize| {
        let json = format!("{{\"item_id\": 1, \"quantity\": 2{}}}", " ".repeat(padding));
        let chunks = json
            .into_bytes()
            .chunks(16)
            .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(c)))
            .collect::<Vec<_>>();
        let mut r = request("POST", "/api/orders", &[], None);
        r.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        *r.body_mut() = Body::from_stream(futures_util::stream::iter(chunks));
        r
    };
    let (status, _, body) = send(&app, order(100)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert!(body.contains("/problems/too-large"), "{body}");
    let (status, _, body) = send(&app, order(0)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(body.contains("\"order_id\":1"), "{body}");
}

/// What the front service asks before it builds a check: a route a policy
/// limits is decided; an unlimited policy's route, or one no policy
/// covers, is not (and `check` would answer `Unlimited` at once for it).
#[test]
fn only_routes_a_policy_limits_are_decided() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml"))
        .unwrap();
    let config = Config::from_toml(&text).unwrap();
    let state = state_with_stack(
        &config,
        in_process_stack(MemoryStore::new(1000, 4)),
        Arc::new(ManualClock::new(T0)),
    );
    let limiter = state.limiter.get();
    let get = http::Method::GET;
    assert!(limiter.decides("/api/items", &get));
    assert!(limiter.decides("/api/orders", &http::Method::POST));
    assert!(!limiter.decides("/api/status", &get), "unlimited = true");
    assert!(!limiter.decides("/healthz", &get), "no policy");
}

/// The request stays in the connection's future and the steps below
/// borrow it: the whole future is copied into place on every request, and
/// a step that held the request by value would add the request's size to
/// it. The ceiling leaves room for the compiler's layout, not for a copy.
#[test]
fn the_answer_future_borrows_the_request() {
    let app = example_app();
    let mut request = request("GET", "/api/items", &[], None);
    let answer = app.answer(&mut request, None);
    let size = std::mem::size_of_val(&answer);
    assert!(
        size <= 1_200,
        "the answer's future is {size} bytes; see src/middleware/front.rs on what it holds"
    );
}

/// A gateway's decision endpoint: the policy of the path in
/// `X-Original-URI`, the client identified as for the API (an API key, or
/// the address a trusted proxy forwards), 204 with the RateLimit fields
/// while admitted, then the API's own 429 with `Retry-After`; a path no
/// policy names is 204 without fields; a question without a path, 400.
#[tokio::test]
async fn the_decision_endpoint_answers_for_another_services_request() {
    let app = app_on(
        "trusted_proxies = [\"192.0.2.10\"]\n\
         [[policies]]\nname = \"reports\"\nroute = \"/reports/\"\nburst = 3\nrate = 1\n",
        in_memory,
    );
    let ask = |path: &str, client: &str| {
        request(
            "GET",
            "/decide",
            &[("x-original-uri", path), ("x-forwarded-for", client)],
            None,
        )
    };
    for remaining in ["2", "1", "0"] {
        let (status, h, body) = send(&app, ask("/reports/daily?day=1", "203.0.113.7")).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
        assert_eq!(h["ratelimit-limit"], "3");
        assert_eq!(h["ratelimit-remaining"], remaining);
        assert_eq!(h["ratelimit-policy"], "\"reports\";q=3;w=3");
    }
    let (status, h, body) = send(&app, ask("/reports/weekly", "203.0.113.7")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "1");
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(body.contains("\"status\":429"), "{body}");
    // Another client (the forwarded address) has its own bucket.
    let (status, _, _) = send(&app, ask("/reports/daily", "203.0.113.8")).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // No policy for the path: admitted, nothing counted.
    let (status, h, _) = send(&app, ask("/elsewhere", "203.0.113.7")).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(h.get("ratelimit-limit").is_none());
    // Traefik's names for the same question.
    let (status, _, _) = send(
        &app,
        request(
            "GET",
            "/decide",
            &[
                ("x-forwarded-uri", "/reports/x"),
                ("x-forwarded-method", "GET"),
            ],
            None,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    for (headers, why) in [
        (vec![], "no X-Original-URI"),
        (vec![("x-original-uri", "reports")], "not a path"),
        (
            vec![
                ("x-original-uri", "/reports/"),
                ("x-original-method", "GE T"),
            ],
            "not an HTTP method",
        ),
    ] {
        let (status, h, body) = send(&app, request("GET", "/decide", &headers, None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}: {body}");
        assert_eq!(h["content-type"], "application/problem+json");
        assert!(body.contains(why), "{body}");
    }
}

/// The sample API's answers are made with room for every field an
/// admitted, limited answer ends up with, so the header map never grows on
/// the request path: the handler's map holds `ANSWER_FIELDS`, and an
/// answer that went through the limiter has no more than that.
#[tokio::test]
async fn answers_are_made_with_room_for_the_limiters_fields() {
    use axum::response::IntoResponse;
    use ratelimiter::headers::ANSWER_FIELDS;
    let made = ratelimiter::api::list_items().await.into_response();
    assert!(
        made.headers().capacity() >= ANSWER_FIELDS,
        "made with room for {} fields",
        made.headers().capacity()
    );
    let app = example_app();
    let key = [("x-api-key", "demo-key-a")];
    let (status, h, _) = send(&app, request("GET", "/api/items", &key, None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(h.contains_key("ratelimit") && h.contains_key("x-instance-id"));
    assert!(
        h.len() <= ANSWER_FIELDS,
        "{} fields: {:?}",
        h.len(),
        h.keys().collect::<Vec<_>>()
    );
}
