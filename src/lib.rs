//! A distributed rate limiter you can watch working and watch failing.
//!
//! # Layout
//! Dependencies point one way, from the top of this list to the bottom
//! (ARCHITECTURE.md draws it):
//!
//! - [`server`]: wiring (the store stack, the limiter, the state, all built
//!   from the config in one place), then bind, serve, shut down gracefully.
//! - [`api`]: the sample API being protected, and `app()` that assembles it
//!   behind the front service.
//! - [`middleware`]: the front service in front of axum's router: the
//!   route template, the limiter's decision (429 and the RateLimit fields),
//!   the request deadline, the early 413, the RED histogram and the span.
//! - [`limiter`]: identity, policy and the store stack, tied together.
//! - [`config`]: the one typed configuration (file, flags, env), validated at
//!   start-up with the bad field named.
//! - [`policy`]: route policies: which limit applies to a request.
//! - [`identity`]: who a request is: API key, or client IP behind trusted
//!   proxies; turned into a keyed hash so stores never hold credentials.
//! - [`headers`]: `RateLimit-*`, `Retry-After` and problem bodies, as pure
//!   functions of a decision.
//! - [`hotkeys`]: which keys are hot: a bounded heavy-hitter detector over
//!   the checks, exported as the top keys with their slot, node and share.
//! - [`mitigation`]: store wrappers that spare the shared store calls for
//!   a hot key, per policy: the deny cache.
//! - [`failover`]: store wrappers for when the shared store misbehaves: a
//!   deadline per call, a circuit breaker, and fail-open, fail-closed or a
//!   bounded local share.
//! - [`store`]: where limit state lives, behind one narrow async trait: the
//!   request ([`store::Check`]) and answer ([`store::Checked`]) every layer
//!   speaks; the in-memory and Redis stores.
//! - [`algorithm`]: the token bucket, GCRA, fixed window, sliding log and
//!   sliding-window counter, each pure: `(limit, state, cost, now)` to
//!   `(decision, state)`; and the one description of what each needs.
//! - [`telemetry`]: logs and OpenTelemetry traces (OTLP), and the HTTP
//!   series and server span the front service records.
//! - [`metrics`]: every metric name, in one place.
//! - [`key`], [`clock`]: shared vocabulary (bucket keys, time as a value
//!   passed in), importing nothing of the crate.
//!
//! # In your own axum service
//!
//! The policy in TOML, the store stack it names, and
//! [`middleware::RateLimitLayer`] on your routes: each request is decided
//! under the policy of its route template; a refusal (429 problem+json
//! with `Retry-After`, or 503 where a policy fails closed) is answered in
//! the handler's place, an admission gets the `RateLimit` fields.
//! `backend = "lua"` and a `[redis]` table share the buckets through
//! Redis, with the deadline, the breaker and the local share in front of
//! it. Serve the app with `into_make_service_with_connect_info` so that
//! clients without an API key are keyed by their address;
//! `examples/axum_service.rs` is the same as a program to run.
//!
//! ```
//! use axum::{Router, body::Body, extract::ConnectInfo, routing::get};
//! use http::{Request, StatusCode};
//! use ratelimiter::{clock::SystemClock, config::Config, server};
//! use ratelimiter::middleware::RateLimitLayer;
//! use std::{net::SocketAddr, sync::Arc};
//! use tower::ServiceExt;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::from_toml(
//!     r#"
//!     [[policies]]
//!     name = "hello"
//!     route = "/hello"
//!     burst = 3
//!     rate = 1
//!     per = "1s"
//!     "#,
//! )?;
//! let stack = server::build_stack(&config).await?;
//! let limiter = Arc::new(server::build_limiter(&config, stack.store, Arc::new(SystemClock)));
//! let app = Router::new()
//!     .route("/hello", get(|| async { "hello\n" }))
//!     .route_layer(RateLimitLayer::new(limiter));
//!
//! // What `axum::serve(listener, app.into_make_service_with_connect_info::
//! // <SocketAddr>())` gives each request of one client: its address.
//! let mut statuses = Vec::new();
//! for _ in 0..4 {
//!     let mut request = Request::get("/hello").body(Body::empty())?;
//!     let client = SocketAddr::from(([203, 0, 113, 7], 50000));
//!     request.extensions_mut().insert(ConnectInfo(client));
//!     let response = app.clone().oneshot(request).await?;
//!     statuses.push(response.status());
//! }
//! // A burst of 3, then refused until a token comes back.
//! assert_eq!(statuses[..3], [StatusCode::OK; 3]);
//! assert_eq!(statuses[3], StatusCode::TOO_MANY_REQUESTS);
//! # Ok(())
//! # }
//! ```

pub mod algorithm;
pub mod api;
pub mod clock;
pub mod config;
pub mod descriptors;
pub mod failover;
pub mod headers;
pub mod hotkeys;
pub mod identity;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod middleware;
pub mod mitigation;
pub mod policy;
pub mod rls;
pub mod server;
pub mod store;
pub mod telemetry;
