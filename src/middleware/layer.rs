//! Builds [`RateLimit`] services around inner services.

use super::service::RateLimit;
use crate::limiter::CurrentLimiter;
use std::sync::Arc;
use tower::Layer;

/// Applies the limiter in force to every route it wraps.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Arc<CurrentLimiter>,
}

impl RateLimitLayer {
    /// A layer deciding through the limiter `limiter` holds.
    pub fn new(limiter: Arc<CurrentLimiter>) -> Self {
        Self { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter))
    }
}
