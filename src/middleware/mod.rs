//! Our code around the API's handlers: [`Front`], one service in front of
//! axum's router that limits, bounds and measures every request (its
//! module docs list the steps in order), and [`RouteTable`], which builds
//! the router and the route templates `Front` matches together.
//!
//! Unlike `tower::limit::RateLimit`, which delays callers in `poll_ready`
//! and keeps per-process state, the limiter decides in the call through
//! the shared [`Limiter`](crate::limiter::Limiter) and answers a denial at
//! once with 429, problem+json and headers that tell the client when to
//! come back. Waiting inside the server would hold a connection and a task
//! per throttled client, which is exactly the load a limiter exists to
//! shed.
//!
//! `front.rs` is the request's path, `routes.rs` the table, `response.rs`
//! turns the limiter's [`Outcome`](crate::limiter::Outcome) into what the
//! client sees. `layer.rs` is the same decision as a tower layer
//! ([`RateLimitLayer`]) for your own service.

mod front;
mod layer;
mod response;
mod routes;

pub use front::{Front, INSTANCE_ID_HEADER};
pub use layer::{RateLimit, RateLimitLayer};
pub use response::Verdict;
pub use routes::{Peer, Route, RouteTable, Routes};
