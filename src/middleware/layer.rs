//! Builds [`RateLimit`] services around inner services.

use super::service::RateLimit;
use crate::limiter::Limiter;
use std::sync::Arc;
use tower::Layer;

/// Applies the shared [`Limiter`] to every route it wraps.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Arc<Limiter>,
}

impl RateLimitLayer {
    /// A layer deciding through `limiter`.
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter))
    }
}
