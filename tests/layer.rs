//! `RateLimitLayer` in an app of its own: the policy found by the route
//! template under `route_layer` and by the path before routing, the
//! inner service never called for a refusal, and a request that cannot be
//! attributed to a client refused, not admitted unlimited.

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use ratelimiter::clock::SystemClock;
use ratelimiter::config::Config;
use ratelimiter::middleware::RateLimitLayer;
use ratelimiter::server::{build_limiter, build_stack};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use tower::ServiceExt;

/// A burst of 2 on `/items/` (templates and paths alike), nothing on
/// `/health`.
const CONFIG: &str = r#"
[[policies]]
name = "items"
route = "/items/"
burst = 2
rate = 1
per = "1h"
"#;

async fn layer() -> RateLimitLayer {
    let config = Config::from_toml(CONFIG).unwrap();
    let stack = build_stack(&config).await.unwrap();
    RateLimitLayer::new(Arc::new(build_limiter(
        &config,
        stack.store,
        Arc::new(SystemClock),
    )))
}

/// An app whose `/items/{id}` handler counts its calls.
fn app(calls: &Arc<AtomicU32>) -> Router {
    let calls = Arc::clone(calls);
    Router::new()
        .route(
            "/items/{id}",
            get(move || async move {
                calls.fetch_add(1, Ordering::Relaxed);
                "item\n"
            }),
        )
        .route("/health", get(|| async { "ok\n" }))
}

fn get_from(path: &str, client: Option<[u8; 4]>) -> Request<Body> {
    let mut request = Request::get(path).body(Body::empty()).unwrap();
    if let Some(ip) = client {
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from((ip, 40000))));
    }
    request
}

/// The statuses of `n` GETs of `path` from `client` through `service`.
async fn statuses<S>(service: &S, path: &str, client: [u8; 4], n: usize) -> Vec<u16>
where
    S: tower::Service<Request<Body>, Response = axum::response::Response> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut out = Vec::new();
    for _ in 0..n {
        let response = service
            .clone()
            .oneshot(get_from(path, Some(client)))
            .await
            .unwrap();
        out.push(response.status().as_u16());
    }
    out
}

#[tokio::test]
async fn under_route_layer_the_template_picks_the_policy_per_client() {
    let calls = Arc::new(AtomicU32::new(0));
    let app = app(&calls).route_layer(layer().await);
    // Two ids, one template: one bucket per client for both.
    let mut seen = statuses(&app, "/items/1", [192, 0, 2, 1], 1).await;
    seen.extend(statuses(&app, "/items/2", [192, 0, 2, 1], 2).await);
    assert_eq!(seen, [200, 200, 429]);
    // The refusal never reached the handler; another client has its own.
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    assert_eq!(statuses(&app, "/items/3", [192, 0, 2, 2], 1).await, [200]);
    // An admission carries the fields, a refusal the problem and when.
    let admitted = app
        .clone()
        .oneshot(get_from("/items/4", Some([192, 0, 2, 3])))
        .await
        .unwrap();
    assert_eq!(admitted.headers()["ratelimit-remaining"], "1");
    statuses(&app, "/items/4", [192, 0, 2, 3], 1).await;
    let refused = app
        .clone()
        .oneshot(get_from("/items/4", Some([192, 0, 2, 3])))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert!(refused.headers().contains_key("retry-after"));
    // A route no policy names is not limited, and gets no fields.
    assert_eq!(statuses(&app, "/health", [192, 0, 2, 1], 5).await, [200; 5]);
}

/// Around the whole router (not a route layer), nothing has matched a
/// template yet: the request's path picks the policy.
#[tokio::test]
async fn before_routing_the_path_picks_the_policy() {
    let calls = Arc::new(AtomicU32::new(0));
    let service = tower::Layer::layer(&layer().await, app(&calls));
    assert_eq!(
        statuses(&service, "/items/9", [198, 51, 100, 1], 3).await,
        [200, 200, 429]
    );
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    // A path no policy names passes, unlimited.
    assert_eq!(
        statuses(&service, "/health", [198, 51, 100, 1], 5).await,
        [200; 5]
    );
}

#[tokio::test]
async fn a_request_without_a_client_is_refused_not_admitted() {
    let calls = Arc::new(AtomicU32::new(0));
    let app = app(&calls).route_layer(layer().await);
    let response = app.oneshot(get_from("/items/1", None)).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}
