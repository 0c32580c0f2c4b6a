//! Your own axum service, limited by this crate: the policy in TOML, the
//! store stack the config names, and the limiter's tower layer, which
//! answers a refused request itself (429 problem+json with `Retry-After`)
//! and lets an admitted one through with the `RateLimit` fields.
//!
//! The stack here is in memory; `backend = "lua"` and a `[redis]` table in
//! the same TOML share every bucket through Redis, with the deadline, the
//! breaker and the local share in front of it (docs/configuration.md).
//!
//! Run with: `cargo run --example axum_service -- 127.0.0.1:3000`, then
//! `for i in 1 2 3 4; do curl -si 127.0.0.1:3000/hello/you | head -1; done`
//! (a burst of 3 a client: the fourth is `429 Too Many Requests`).

use axum::Router;
use axum::extract::Path;
use axum::routing::get;
use ratelimiter::clock::SystemClock;
use ratelimiter::config::Config;
use ratelimiter::middleware::RateLimitLayer;
use ratelimiter::server::{build_limiter, build_stack};
use std::net::SocketAddr;
use std::sync::Arc;

/// A burst of 3, then one a second, per client address (or per API key,
/// given `[[api_keys]]`).
const CONFIG: &str = r#"
[[policies]]
name = "hello"
route = "/hello/"
burst = 3
rate = 1
per = "1s"
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_toml(CONFIG)?;
    let stack = build_stack(&config).await?;
    let limiter = Arc::new(build_limiter(&config, stack.store, Arc::new(SystemClock)));
    let app = Router::new()
        .route(
            "/hello/{name}",
            get(|Path(name): Path<String>| async move { format!("hello, {name}\n") }),
        )
        // A route layer runs after routing, so the policy is chosen by the
        // route's template.
        .route_layer(RateLimitLayer::new(limiter));
    let address = std::env::args().nth(1).unwrap_or("127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on {}", listener.local_addr()?);
    // With the connection's address, for clients without an API key.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
