//! The rate-limit middleware: a tower [`Layer`](tower::Layer) for axum.
//!
//! Unlike `tower::limit::RateLimit`, which delays callers in `poll_ready`
//! and keeps per-process state, this decides in `call` through the shared
//! [`Limiter`](crate::limiter::Limiter) and answers a denial at once with
//! 429, problem+json and headers that tell the client when to come back.
//! Waiting inside the server would hold a connection and a task per
//! throttled client, which is exactly the load a limiter exists to shed.
//!
//! `layer.rs` builds, `service.rs` decides, `response.rs` turns the
//! limiter's [`Outcome`](crate::limiter::Outcome) into what the client sees.

mod layer;
mod response;
mod service;

pub use layer::RateLimitLayer;
pub use response::Verdict;
pub use service::RateLimit;
