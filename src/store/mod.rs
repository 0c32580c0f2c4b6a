//! Where bucket state lives, behind one narrow trait.
//!
//! A store answers one question: "check `cost` against bucket `key` shaped
//! `limit` at `now`". It does not pick keys, read clocks or decide what a
//! failure means; those belong to the limiter and to wrappers around a store.
//! The trait is object safe (boxed futures) so the backend can be chosen at
//! start-up from the config; the in-memory store also exposes a synchronous
//! method for callers that can use it directly.

mod memory;
pub mod redis;

pub use memory::MemoryStore;
pub use redis::{LuaStore, NaiveStore};

use crate::bucket::{CostExceedsBurst, Decision, Limit};
use crate::clock::Micros;
use std::fmt;
use std::future::Future;
use std::pin::Pin;

/// A boxed, sendable future, as returned by [`Store::check`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The key of one bucket: a keyed 128-bit hash of (policy, client identity).
///
/// Being a keyed hash, it is uniformly distributed and cannot be steered by
/// clients, which is what lets stores use its bits directly for sharding and
/// hashing, and it never reveals the credential or address it came from.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey(pub u128);

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BucketKey({self})")
    }
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request can never fit the bucket (a configuration error).
    #[error(transparent)]
    CostExceedsBurst(#[from] CostExceedsBurst),
    /// Redis failed or did not answer in time.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// This store implements the token bucket only (config validation
    /// refuses other algorithms with such a backend).
    #[error("the {backend} store does not implement {algorithm}")]
    UnsupportedAlgorithm {
        /// The store's backend name.
        backend: &'static str,
        /// The algorithm asked for.
        algorithm: &'static str,
    },
}

impl StoreError {
    /// Whether the request itself is at fault (configuration), not the
    /// store: such errors are not failures to fail over from.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            StoreError::CostExceedsBurst(_) | StoreError::UnsupportedAlgorithm { .. }
        )
    }

    /// Refuses anything but the token bucket (for stores that only have it).
    pub fn token_bucket_only(backend: &'static str, limit: &Limit) -> Result<(), StoreError> {
        match limit.algorithm() {
            crate::algorithm::Algorithm::TokenBucket => Ok(()),
            other => Err(StoreError::UnsupportedAlgorithm {
                backend,
                algorithm: other.as_str(),
            }),
        }
    }

    /// The bounded label used for this error in metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::CostExceedsBurst(_) => "cost_exceeds_burst",
            StoreError::UnsupportedAlgorithm { .. } => "unsupported_algorithm",
            StoreError::Redis(e) => redis_error_kind(e),
        }
    }
}

/// Classifies a Redis error into one bounded metric label. Order matters:
/// a timeout is also an I/O error, and a refusal is also a dropped connection.
pub fn redis_error_kind(e: &::redis::RedisError) -> &'static str {
    use ::redis::{ErrorKind, ServerErrorKind};
    if e.is_timeout() {
        "timeout"
    } else if e.is_connection_refusal() {
        "connection_refused"
    } else if e.is_connection_dropped() {
        "connection_dropped"
    } else if e.is_io_error() {
        "io"
    } else {
        match e.kind() {
            ErrorKind::Server(
                ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::CrossSlot,
            ) => "cluster",
            ErrorKind::ClusterConnectionNotFound => "cluster",
            ErrorKind::Server(ServerErrorKind::BusyLoading) => "loading",
            ErrorKind::Server(ServerErrorKind::NoScript) => "noscript",
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown) => {
                "readonly"
            }
            ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm) => "auth",
            ErrorKind::Server(_) => "server",
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType => "response",
            _ => "client",
        }
    }
}

/// Shared bucket state.
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Decide a request of `cost` tokens for bucket `key` at `now`, and
    /// record the spend if admitted.
    fn check(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        self.check_within(key, limit, cost, now, None)
    }

    /// [`Store::check`] with the bucket holding at most `ceiling` units
    /// after refill (see [`crate::bucket::check_within`]): how a bucket is
    /// handed back from a local fallback without a fresh burst.
    fn check_within(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>>;

    /// The backend's name, as used in metric labels and logs.
    fn backend(&self) -> &'static str;

    /// Whether the state lives in this process (nothing to fail over from:
    /// the failure policy leaves such a store alone).
    fn in_process(&self) -> bool {
        false
    }

    /// Whether the store can decide right now (for `/readyz`).
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}
