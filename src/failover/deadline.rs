//! A deadline on every call to the store it wraps.
//!
//! A limiter that stalls with Redis is worse than none: a request never
//! waits on the store longer than this (default 10 ms, against a loopback
//! round trip of ~0.1 ms). A call that misses it answers
//! [`StoreError::Deadline`] at once, which the failure policy above decides
//! by its failure mode. It bounds the wait whatever the Redis client's own
//! timeouts are.
//!
//! # Late answers
//! Missing the deadline does not prove Redis slow: on an instance whose CPU
//! is saturated, Redis answers as quickly as ever and the answer waits in
//! the socket until the runtime gets to it. Blaming Redis for that would
//! open every breaker of a CPU-bound fleet and send its decisions to the
//! local share. So the call is not dropped at the deadline: it goes on
//! in the background for the rest of its allowance (`late_within`, the
//! Redis client's own response timeout in the service), and the
//! [`Late`] in the error says, when it ends, whether the store answered.
//! The failure policy counts an answer as the store alive, and only a call
//! that fails or outlasts its allowance as the store failing. The request
//! itself was decided at the deadline either way.

use crate::store::{Check, CheckFuture, Late, Layer, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// Bounds every call to `inner` by `deadline`.
#[derive(Debug)]
pub struct Deadline<S> {
    inner: Arc<S>,
    deadline: Duration,
    /// How long after its start a call may still answer (no longer than
    /// `deadline`: the call is dropped at the deadline).
    late_within: Duration,
}

impl<S> Deadline<S> {
    /// Wraps `inner`; a call that misses the deadline is dropped.
    pub fn new(inner: S, deadline: Duration) -> Self {
        Self {
            inner: Arc::new(inner),
            deadline,
            late_within: deadline,
        }
    }

    /// A call that misses the deadline goes on until `allowance` after its
    /// start, and its error's [`Late`] says whether it was answered.
    pub fn late_within(self, allowance: Duration) -> Self {
        Self {
            late_within: allowance.max(self.deadline),
            ..self
        }
    }
}

impl<S: Store> Layer for Deadline<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        // Owning its store, so that a late call can go on in a task of its
        // own: the store's own future, not one more box around it.
        let mut call = Arc::clone(&self.inner).check_owned(check);
        let (deadline, late_within) = (self.deadline, self.late_within);
        CheckFuture::waiting(async move {
            // One clock read: the deadline is taken from the start.
            let start = tokio::time::Instant::now();
            if let Ok(result) = tokio::time::timeout_at(start + deadline, &mut call).await {
                return result;
            }
            let rest = late_within.saturating_sub(start.elapsed());
            if rest.is_zero() {
                return Err(StoreError::Deadline(Late::unknown()));
            }
            let (answered, late) = Late::pending();
            tokio::spawn(async move {
                let outcome = match tokio::time::timeout(rest, call).await {
                    Ok(Ok(_)) => true,
                    // The store answered: the request was at fault.
                    Ok(Err(e)) => e.is_request_error(),
                    // Dropped now, past its allowance.
                    Err(_) => false,
                };
                let _ = answered.send(outcome);
            });
            Err(StoreError::Deadline(late))
        })
    }

    fn longest_wait(&self) -> Option<Duration> {
        Some(self.deadline)
    }
}
