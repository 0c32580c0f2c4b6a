//! A distributed rate limiter you can watch working and watch failing.
//!
//! # Layout
//! - [`clock`]: time as a value passed in: the system clock, a TSC-based
//!   wall clock for the request path, and a manual clock for tests.
//! - [`bucket`]: the exact token bucket, pure: `(limit, state, cost, now)` to
//!   `(decision, state)`.
//! - [`algorithm`]: GCRA, fixed window, sliding log and sliding-window
//!   counter, each pure and exact like the bucket, with the same decision.
//! - [`store`]: where bucket state lives, behind one narrow async trait; the
//!   in-memory, sharded, memory-bounded store is here.
//! - [`failover`]: what happens when the shared store misbehaves: a
//!   deadline per check, a circuit breaker, and fail-open, fail-closed or a
//!   bounded local share, as a wrapper around a store.
//! - [`identity`]: who a request is: API key, or client IP behind trusted
//!   proxies; turned into a keyed hash so stores never hold credentials.
//! - [`headers`]: `RateLimit-*`, `Retry-After` and problem bodies, as pure
//!   functions of a decision.
//! - [`config`]: the one typed configuration (file, flags, env), validated at
//!   start-up with the bad field named.
//! - [`policy`]: route policies resolved from the config, and the limiter that
//!   ties identity, policy and store together.
//! - [`limit`]: the tower layer that decides in `call` and answers 429.
//! - [`metrics`]: every metric name, in one place.
//! - [`api`]: the sample API being protected, and `app()` that assembles it.
//! - [`server`]: bind, serve, shut down gracefully.

pub mod algorithm;
pub mod api;
pub mod bucket;
pub mod clock;
pub mod config;
pub mod failover;
pub mod headers;
pub mod identity;
pub mod limit;
pub mod metrics;
pub mod policy;
pub mod server;
pub mod store;
