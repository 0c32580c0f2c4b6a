//! The peer of `loadtest http-cost`: a minimal axum app limiting the
//! sample API's `GET /api/items` (same body) with tower_governor, keyed by
//! peer address as our anonymous policy is, with its rate-limit headers
//! (`x-ratelimit-limit`, `x-ratelimit-remaining`) on. The limit is far
//! above any load, as in the harness's memory variant, so every request is
//! checked and admitted. Our memory-limited route is measured against it.
//!
//! `cargo run --release --example peer_governor -- 127.0.0.1:8080`

mod common;

use axum::Router;
use axum::routing::get;
use std::time::Duration;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

#[tokio::main]
async fn main() {
    // 10^8 per second, a burst of 10^8: the memory variant's policy.
    let config = GovernorConfigBuilder::default()
        .period(Duration::from_nanos(10))
        .burst_size(100_000_000)
        .use_headers()
        .finish()
        .expect("a valid quota");
    let app = Router::new()
        .route("/api/items", get(common::list_items))
        .layer(GovernorLayer::new(config));
    common::serve(app).await;
}
