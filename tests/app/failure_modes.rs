//! The failure modes on a store whose Redis refuses every call: open,
//! closed, the local share, and a request the store itself refuses.

use super::*;
use ratelimiter::algorithm::CostExceedsBurst;
use ratelimiter::server::shared_stack;
use ratelimiter::store::{BoxFuture, Check, CheckFuture, Store, StoreError};

/// A store whose Redis refuses every connection, or (`config_error`) that
/// refuses the request itself.
#[derive(Debug)]
struct BrokenStore {
    config_error: bool,
}

fn refused() -> StoreError {
    StoreError::Redis(redis::RedisError::from(std::io::Error::from(
        std::io::ErrorKind::ConnectionRefused,
    )))
}

impl Store for BrokenStore {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        let error = if self.config_error {
            CostExceedsBurst {
                cost: check.cost,
                burst: check.limit.burst(),
            }
            .into()
        } else {
            refused()
        };
        CheckFuture::ready(Err(error))
    }

    fn backend(&self) -> &'static str {
        "broken"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Err(refused())))
    }
}

/// The app with the stack `server.rs` builds around a shared store, on a
/// broken one.
fn broken_app(toml: &str, config_error: bool) -> Front {
    app_on(toml, |config| {
        shared_stack(BrokenStore { config_error }, config)
    })
}

#[tokio::test]
async fn failing_closed_refuses_with_503_and_retry_after_not_429() {
    let app = broken_app("[failure]\nmode = \"closed\"\n", false);
    let (status, h, body) = send(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(body.contains("limiter-unavailable"), "{body}");
    assert!(
        !body.contains("refused"),
        "internal error text leaked: {body}"
    );
    let (_, _, metrics) = send(&app, request("GET", "/metrics", &[], None)).await;
    let line = r#"ratelimit_decisions_total{policy="api",decision="unavailable",key_kind="ip",source="failclosed"}"#;
    assert!(metrics.contains(line), "{line} missing");
    // Readiness says so, and with `closed` that is a 503: this instance
    // cannot serve limited routes.
    let (status, _, body) = send(&app, request("GET", "/readyz", &[], None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("\"degraded\""), "{body}");
    // Operations endpoints do not depend on the store.
    let (status, _, _) = send(&app, request("GET", "/healthz", &[], None)).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn failing_open_admits_without_made_up_rate_limit_headers() {
    let app = broken_app("[failure]\nmode = \"open\"\n", false);
    for _ in 0..150 {
        let (status, h, _) = send(&app, request("GET", "/api/items", &[], None)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!h.contains_key("ratelimit-remaining"));
        assert!(!h.contains_key("ratelimit"));
    }
    let (_, _, metrics) = send(&app, request("GET", "/metrics", &[], None)).await;
    let line = r#"ratelimit_decisions_total{policy="api",decision="allowed",key_kind="ip",source="failopen"}"#;
    assert!(metrics.contains(line), "{line} missing");
}

#[tokio::test]
async fn failing_local_enforces_the_share_and_says_so_in_the_headers() {
    let app = broken_app(
        "[failure]\ninstances = 4\n[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 40\nrate = 4\n\n[[policies]]\nname = \"orders\"\nroute = \"/api/orders\"\nburst = 40\nrate = 4\nfailure_mode = \"closed\"\n",
        false,
    );
    let mut admitted = 0;
    for _ in 0..40 {
        let (status, h, _) = send(&app, request("GET", "/api/items", &[], None)).await;
        if status == StatusCode::OK {
            admitted += 1;
            assert_eq!(h["ratelimit-limit"], "10");
        } else {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        }
    }
    assert_eq!(admitted, 10, "a quarter of the burst on this instance");
    // Who decided, why Redis could not, and the breaker, on /metrics.
    let (_, _, metrics) = send(&app, request("GET", "/metrics", &[], None)).await;
    for line in [
        r#"ratelimit_decisions_total{policy="api",decision="allowed",key_kind="ip",source="local"}"#,
        r#"ratelimit_decisions_total{policy="api",decision="denied",key_kind="ip",source="local"}"#,
        r#"ratelimit_store_errors_total{backend="broken",kind="connection_refused"}"#,
        r#"ratelimit_breaker_transitions_total{node="broken",from="closed",to="open"}"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    // Readiness: degraded but serving (200), so balancers keep the instance.
    let (status, _, body) = send(&app, request("GET", "/readyz", &[], None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        body.contains("\"degraded\"")
            && body.contains("\"local\"")
            && body.contains(r#""degraded_nodes":[{"breaker":"open","node":"broken"}]"#),
        "{body}"
    );
    // A policy's own failure mode overrides the default.
    let (status, _, _) = send(
        &app,
        request(
            "POST",
            "/api/orders",
            &[],
            Some(r#"{"item_id":1,"quantity":1}"#),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn a_request_the_store_itself_refuses_is_a_500_not_admitted() {
    let app = broken_app("", true);
    let (status, h, body) = send(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(
        !body.contains("burst"),
        "internal error text leaked: {body}"
    );
}
