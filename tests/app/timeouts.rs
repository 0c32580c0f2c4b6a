//! The request timer against the store's own bound: a check nothing
//! bounds is cut at the request timeout, one the deadline bounds runs
//! without the timer and leaves the handler the rest.

use super::*;
use ratelimiter::server::{mitigated, shared_stack};
use ratelimiter::store::{Check, CheckFuture, Store};
use std::time::Duration;

/// A store whose checks never answer: a hung network store, with nothing
/// of its own to bound the wait.
#[derive(Debug)]
struct HungStore;

impl Store for HungStore {
    fn check(&self, _: Check) -> CheckFuture<'_> {
        CheckFuture::waiting(std::future::pending())
    }

    fn backend(&self) -> &'static str {
        "hung"
    }
}

/// `app`'s status for `request`, and how long (on the test's clock, paused
/// and advanced only when every task waits) it took; a request never
/// answered fails the test instead of hanging it.
async fn timed(app: &Front, request: Request<Body>) -> (StatusCode, Duration) {
    let started = tokio::time::Instant::now();
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(3600), send(app, request))
        .await
        .expect("never answered: nothing cut the request");
    if status == StatusCode::REQUEST_TIMEOUT {
        assert!(body.contains("/problems/request-timeout"), "{body}");
    }
    (status, started.elapsed())
}

/// `took` is `at`, give or take the runtime's millisecond ticks.
fn assert_took(took: Duration, at: Duration) {
    assert!(
        took >= at && took < at + Duration::from_millis(50),
        "took {took:?}, not {at:?}"
    );
}

/// The front spares a check its request timer only when the store stack
/// bounds the check within the request timeout: each layer says how long
/// it can wait, and a store that does not say is taken as unbounded.
#[test]
fn each_stack_says_how_long_a_check_can_wait() {
    let config = Config::from_toml("[failure]\ndeadline = \"300ms\"\n").unwrap();
    let memory = in_process_stack(MemoryStore::new(1000, 4));
    assert_eq!(memory.store.longest_wait(), Some(Duration::ZERO));
    assert_eq!(
        mitigated(memory, &config).store.longest_wait(),
        Some(Duration::ZERO)
    );
    let shared = shared_stack(HungStore, &config);
    assert_eq!(
        shared.store.longest_wait(),
        Some(Duration::from_millis(300))
    );
    // A lease is taken with the request's own call: no second one.
    assert_eq!(
        mitigated(shared, &config).store.longest_wait(),
        Some(Duration::from_millis(300))
    );
    assert_eq!(HungStore.longest_wait(), None);
}

/// A check nothing bounds is cut by the request timeout: 408, on time.
#[tokio::test(start_paused = true)]
async fn a_check_nothing_bounds_is_cut_at_the_request_timeout() {
    let app = app_on("[http]\nrequest_timeout = \"2s\"\n", |_| Stack {
        store: Arc::new(HungStore),
        breaker: None,
    });
    let (status, took) = timed(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert_took(took, Duration::from_secs(2));
}

/// A deadline no shorter than the request timeout does not stand in for
/// it: the request is cut at its own timeout, not decided by the failure
/// policy at the deadline.
#[tokio::test(start_paused = true)]
async fn a_deadline_past_the_request_timeout_does_not_replace_it() {
    let toml = "[http]\nrequest_timeout = \"1s\"\n[failure]\ndeadline = \"5s\"\n";
    let app = app_on(toml, |config| shared_stack(HungStore, config));
    let (status, took) = timed(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert_took(took, Duration::from_secs(1));
}

/// A check bounded within the request timeout runs without the request's
/// timer (the store's deadline decides it), and the handler gets what it
/// left: a body that stalls after a check that waited its whole deadline
/// is cut at the request timeout from the start, not a deadline later.
#[tokio::test(start_paused = true)]
async fn a_bounded_check_leaves_the_handler_the_rest_of_the_request_timeout() {
    let toml = "[http]\nrequest_timeout = \"1s\"\n[failure]\ndeadline = \"300ms\"\n";
    let app = app_on(toml, |config| shared_stack(HungStore, config));
    // The deadline decides (the local share admits), then the handler waits.
    let (status, took) = timed(&app, request("GET", "/api/items", &[], None)).await;
    assert_eq!(status, StatusCode::OK);
    assert_took(took, Duration::from_millis(300));
    let mut stalled = request("POST", "/api/orders", &[], None);
    stalled
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    *stalled.body_mut() = Body::from_stream(futures_util::stream::pending::<
        Result<bytes::Bytes, std::io::Error>,
    >());
    let (status, took) = timed(&app, stalled).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert_took(took, Duration::from_secs(1));
}
