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
//! The policy in TOML, the store stack it names, and a route layer that
//! asks the [`limiter::Limiter`] about each request: a refusal
//! ([`middleware::Verdict::Answer`]: 429 problem+json with `Retry-After`,
//! or 503 where a policy fails closed) is answered in the handler's place,
//! an admission gets the `RateLimit` fields. `backend = "lua"` and a
//! `[redis]` table share the buckets through Redis, with the deadline, the
//! breaker and the local share in front of it. `examples/axum_service.rs`
//! is the same as a program to run.
//!
//! ```no_run
//! use axum::extract::{ConnectInfo, MatchedPath, Request, State};
//! use axum::middleware::{from_fn_with_state, Next};
//! use axum::response::Response;
//! use axum::{routing::get, Router};
//! use ratelimiter::{clock::SystemClock, config::Config, limiter::Limiter};
//! use ratelimiter::{middleware::Verdict, server};
//! use std::{net::SocketAddr, sync::Arc};
//!
//! async fn limit(
//!     State(limiter): State<Arc<Limiter>>,
//!     ConnectInfo(peer): ConnectInfo<SocketAddr>,
//!     route: MatchedPath,
//!     request: Request,
//!     next: Next,
//! ) -> Response {
//!     let (method, headers) = (request.method(), request.headers());
//!     let outcome = limiter.check(route.as_str(), method, headers, Some(peer.ip())).await;
//!     match Verdict::from(outcome) {
//!         Verdict::Answer(refusal) => refusal,
//!         Verdict::Pass(fields) => {
//!             let mut response = next.run(request).await;
//!             fields.write_to(response.headers_mut());
//!             response
//!         }
//!     }
//! }
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
//!     .route_layer(from_fn_with_state(limiter, limit));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
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
