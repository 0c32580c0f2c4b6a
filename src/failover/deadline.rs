//! A deadline on every call to the store it wraps.
//!
//! A limiter that stalls with Redis is worse than none: a request never
//! waits on the store longer than this (default 10 ms, against a loopback
//! round trip of ~0.1 ms). A call that misses it is dropped and answers
//! [`StoreError::Deadline`], which the failure policy above treats like any
//! other store failure. It bounds the wait whatever the Redis client's own
//! timeouts are.

use crate::store::{BoxFuture, Check, Checked, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// Bounds every call to `inner` by `deadline`.
#[derive(Debug)]
pub struct Deadline<S> {
    inner: S,
    deadline: Duration,
}

impl<S> Deadline<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, deadline: Duration) -> Self {
        Self { inner, deadline }
    }
}

impl<S: Store> Store for Deadline<S> {
    fn check(&self, check: Check) -> BoxFuture<'_, Result<Checked, StoreError>> {
        let call = self.inner.check(check);
        let deadline = self.deadline;
        Box::pin(async move {
            tokio::time::timeout(deadline, call)
                .await
                .unwrap_or(Err(StoreError::Deadline))
        })
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.ready()
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        self.inner.slot_owner(slot)
    }
}
