//! Why a store could not decide, each reason one bounded metric label.

use crate::algorithm::CostExceedsBurst;
use std::time::Duration;

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request can never fit the limit (a configuration error).
    #[error(transparent)]
    CostExceedsBurst(#[from] CostExceedsBurst),
    /// This store does not keep this algorithm at this size (config
    /// validation refuses such policies at start-up).
    #[error("the {backend} store does not implement {algorithm} for this limit")]
    UnsupportedAlgorithm {
        /// The store's backend name.
        backend: &'static str,
        /// The algorithm asked for.
        algorithm: &'static str,
    },
    /// Redis failed or did not answer in time.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// The call outlasted the check's deadline (and was dropped).
    #[error("the store did not answer within the deadline")]
    Deadline,
    /// The shared store is away and the policy fails closed.
    #[error("the shared store is unavailable")]
    Unavailable {
        /// When a retry may succeed (the breaker's next probe, at least 1 s).
        retry_after: Duration,
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

    /// The bounded label used for this error in metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::CostExceedsBurst(_) => "cost_exceeds_burst",
            StoreError::UnsupportedAlgorithm { .. } => "unsupported_algorithm",
            StoreError::Redis(e) => redis_error_kind(e),
            StoreError::Deadline => "deadline",
            StoreError::Unavailable { .. } => "unavailable",
        }
    }
}

/// Classifies a Redis error into one bounded metric label. Order matters:
/// a timeout is also an I/O error, and a refusal is also a dropped
/// connection; a TLS failure (`tls`: the handshake or a certificate) is an
/// I/O error with rustls's error inside.
pub fn redis_error_kind(e: &::redis::RedisError) -> &'static str {
    use ::redis::{ErrorKind, ServerErrorKind};
    if e.is_timeout() {
        "timeout"
    } else if e.is_connection_refusal() {
        "connection_refused"
    } else if e.is_connection_dropped() {
        "connection_dropped"
    } else if super::redis::tls::is_tls_error(e) {
        "tls"
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
