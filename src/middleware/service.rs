//! Decides in `call`: pass through with headers, or answer in the API's place.

use super::response::Verdict;
use crate::limiter::CurrentLimiter;
use crate::store::BoxFuture;
use axum::body::Body;
use axum::extract::{ConnectInfo, MatchedPath};
use axum::response::Response;
use http::Request;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower::Service;

/// The middleware service. See the [module docs](crate::middleware).
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: Arc<CurrentLimiter>,
}

impl<S> RateLimit<S> {
    /// Wraps `inner`, deciding through the limiter in force in `limiter`.
    pub fn new(inner: S, limiter: Arc<CurrentLimiter>) -> Self {
        Self { inner, limiter }
    }
}

impl<S> Service<Request<Body>> for RateLimit<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the inner service's; the limit is applied in `call`.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone is not ready; the ready one is taken for this call
        // (the standard tower pattern for services used from a future).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // Taken now and kept to the end: a reload never splits a request.
        let limiter = self.limiter.get();
        Box::pin(async move {
            // Borrowed from the request the future owns, not copied: the
            // profile showed this template's `String` on every request.
            let route = request
                .extensions()
                .get::<MatchedPath>()
                .map_or_else(|| request.uri().path(), MatchedPath::as_str);
            let peer = request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip());
            let outcome = limiter
                .check(route, request.method(), request.headers(), peer)
                .await;
            match Verdict::from(outcome) {
                Verdict::Answer(response) => Ok(response),
                Verdict::Pass(headers) => {
                    let mut response = inner.call(request).await?;
                    response.headers_mut().extend(headers);
                    Ok(response)
                }
            }
        })
    }
}
