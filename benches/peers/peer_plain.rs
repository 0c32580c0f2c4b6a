//! The baseline of `loadtest http-cost`: a plain axum app serving the
//! sample API's `GET /api/items` (same body), with no middleware at all.
//! Our unlimited route is measured against it.
//!
//! `cargo run --release --example peer_plain -- 127.0.0.1:8080`

mod common;

use axum::Router;
use axum::routing::get;

#[tokio::main]
async fn main() {
    common::serve(Router::new().route("/api/items", get(common::list_items))).await;
}
