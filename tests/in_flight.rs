//! `ratelimit_checks_in_flight`, in a test binary of its own: the gauge
//! is the process's, and other tests' checks would be counted in it.

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use ratelimiter::api::app;
use ratelimiter::clock::ManualClock;
use ratelimiter::config::Config;
use ratelimiter::middleware::Front;
use ratelimiter::server::{Stack, state_with_stack};
use ratelimiter::store::{BoxFuture, Check, CheckFuture, MemoryStore, Store, StoreError};
use std::net::SocketAddr;
use std::sync::Arc;
use tower::ServiceExt;

const T0: u64 = 1_800_000_000_000_000;

fn request(uri: &str) -> Request<Body> {
    let mut r = Request::builder().uri(uri).body(Body::empty()).unwrap();
    r.extensions_mut().insert(ConnectInfo(
        "192.0.2.10:5000".parse::<SocketAddr>().unwrap(),
    ));
    r
}

/// The status and body of `app`'s answer to `GET uri`.
async fn get(app: &Front, uri: &str) -> (StatusCode, String) {
    use http_body_util::BodyExt;
    let r = app.clone().oneshot(request(uri)).await.unwrap();
    let status = r.status();
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// An in-process store whose answers wait until released, as a networked
/// store's do.
#[derive(Debug)]
struct GatedStore {
    inner: MemoryStore,
    open: Arc<tokio::sync::Semaphore>,
}

impl Store for GatedStore {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        CheckFuture::waiting(async move {
            let _pass = self.open.acquire().await.unwrap();
            self.inner.check(check).await
        })
    }

    fn backend(&self) -> &'static str {
        "gated"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// The in-flight gauge (0 before its first check registers it).
fn in_flight(body: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix("ratelimit_checks_in_flight "))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// `ratelimit_checks_in_flight` counts the checks waiting on the store,
/// and only while they wait. (The gauge is the process's: this test has
/// a binary of its own, so no other test's checks are counted in it.)
#[tokio::test]
async fn checks_waiting_on_the_store_are_counted_in_flight() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml"))
        .unwrap();
    let config = Config::from_toml(&text).unwrap();
    let open = Arc::new(tokio::sync::Semaphore::new(0));
    let stack = Stack {
        store: Arc::new(GatedStore {
            inner: MemoryStore::new(1000, 4),
            open: Arc::clone(&open),
        }),
        breaker: None,
    };
    let gated = app(state_with_stack(
        &config,
        stack,
        Arc::new(ManualClock::new(T0)),
    ));
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let gated = gated.clone();
            tokio::spawn(async move { get(&gated, "/api/items").await })
        })
        .collect();
    let mut counted = 0.0;
    for _ in 0..200 {
        let (_, body) = get(&gated, "/metrics").await;
        counted = in_flight(&body);
        if counted == 2.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(counted, 2.0, "two checks wait on the store");
    open.add_permits(2);
    for answer in waiting {
        assert_eq!(answer.await.unwrap().0, StatusCode::OK);
    }
    let (_, body) = get(&gated, "/metrics").await;
    assert_eq!(in_flight(&body), 0.0);
}
