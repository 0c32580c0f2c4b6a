//! Your own axum service, limited by this crate: the policy in TOML, the
//! store stack the config names, and a middleware that asks the limiter
//! about each request, then answers for it (429 problem+json with
//! `Retry-After`) or lets it through with the `RateLimit` fields.
//!
//! The stack here is in memory; `backend = "lua"` and a `[redis]` table in
//! the same TOML share every bucket through Redis, with the deadline, the
//! breaker and the local share in front of it (docs/configuration.md).
//!
//! Run with: `cargo run --example axum_service -- 127.0.0.1:3000`, then
//! `for i in 1 2 3 4; do curl -si 127.0.0.1:3000/hello/you | head -1; done`
//! (a burst of 3 a client: the fourth is `429 Too Many Requests`).

use axum::Router;
use axum::extract::{ConnectInfo, MatchedPath, Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use ratelimiter::clock::SystemClock;
use ratelimiter::config::Config;
use ratelimiter::limiter::Limiter;
use ratelimiter::middleware::Verdict;
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

/// Decides each request under the policy of its route template.
async fn limit(
    State(limiter): State<Arc<Limiter>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    route: MatchedPath,
    request: Request,
    next: Next,
) -> Response {
    let outcome = limiter
        .check(
            route.as_str(),
            request.method(),
            request.headers(),
            Some(peer.ip()),
        )
        .await;
    match Verdict::from(outcome) {
        Verdict::Answer(refusal) => refusal,
        Verdict::Pass(fields) => {
            let mut response = next.run(request).await;
            fields.write_to(response.headers_mut());
            response
        }
    }
}

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
        // A route layer runs after routing, so the template is known.
        .route_layer(middleware::from_fn_with_state(limiter, limit));
    let address = std::env::args().nth(1).unwrap_or("127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
