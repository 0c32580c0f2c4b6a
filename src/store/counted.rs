//! The one place store errors are counted.
//!
//! Errors happen deep in the stack (a refused connection, a missed
//! deadline) and are often absorbed above it (the failure policy decides
//! instead), so counting them wherever they surface would count some twice
//! and others never. This wrapper sits right above the backend (and its
//! deadline) and counts each error once, by backend and kind.

use super::{Check, CheckFuture, CheckResult, Layer, Observe, Store};
use crate::metrics as m;

/// Counts every error of the store it wraps in
/// `ratelimit_store_errors_total{backend, kind}`.
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
}

impl<S: Store> Observe for Counted<S> {
    fn observe(&self, result: &CheckResult) {
        if let Err(e) = result {
            metrics::counter!(
                m::STORE_ERRORS_TOTAL,
                "backend" => self.inner.backend(),
                "kind" => e.kind(),
            )
            .increment(1);
        }
    }
}

impl<S> Counted<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S: Store> Layer for Counted<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        // Looked at, not wrapped: no box around a check that waits.
        self.inner.check(check).observe(self)
    }
}
