//! The limiter as a tower layer, for your own service: what [`super::Front`]
//! does for the sample API, reduced to the decision.
//!
//! Each request is decided by the [`Limiter`] under the policy of its route
//! before the inner service sees it: a refusal (429 problem+json with
//! `Retry-After`, 503 where a policy fails closed, 400 or 401 for a bad
//! identity) is answered in the service's place, an admitted request gets
//! the `RateLimit` fields on the service's response. The route is axum's
//! route template ([`MatchedPath`]) where the router has matched one
//! (the layer added with `Router::route_layer`), else the request's path:
//! a policy's `route` is a prefix of either. A client is keyed by its
//! verified API key, else by its address, which axum gives the request
//! when the app is served with `into_make_service_with_connect_info`; a
//! request with neither is answered 500, never admitted unlimited.

use super::Verdict;
use crate::limiter::Limiter;
use axum::extract::{ConnectInfo, MatchedPath};
use axum::response::Response;
use http::Request;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Limits the requests of the service it wraps: see the module docs.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Arc<Limiter>,
}

impl RateLimitLayer {
    /// A layer deciding with `limiter`.
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self { limiter }
    }
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            limiter: Arc::clone(&self.limiter),
        }
    }
}

/// A service whose requests the limiter decides first ([`RateLimitLayer`]).
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: Arc<Limiter>,
}

impl<S, B> tower::Service<Request<B>> for RateLimit<S>
where
    S: tower::Service<Request<B>, Response = Response> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready is the one to call later; a clone takes
        // its place for the next request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limiter = Arc::clone(&self.limiter);
        // Only the head is looked at across the wait: a body need not be
        // Sync.
        let (head, body) = request.into_parts();
        Box::pin(async move {
            let route = match head.extensions.get::<MatchedPath>() {
                Some(template) => template.as_str(),
                None => head.uri.path(),
            };
            let peer = head
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|ConnectInfo(address)| address.ip());
            let outcome = limiter
                .check(route, &head.method, &head.headers, peer)
                .await;
            match Verdict::from(outcome) {
                Verdict::Answer(refusal) => Ok(refusal),
                Verdict::Pass(fields) => {
                    let mut response = inner.call(Request::from_parts(head, body)).await?;
                    fields.write_to(response.headers_mut());
                    Ok(response)
                }
            }
        })
    }
}
