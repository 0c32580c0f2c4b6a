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
    /// The call outlasted the check's deadline; whether the store still
    /// answered is known later (see [`Late`]).
    #[error("the store did not answer within the deadline")]
    Deadline(Late),
    /// The shared store is away and the policy fails closed.
    #[error("the shared store is unavailable")]
    Unavailable {
        /// When a retry may succeed (the breaker's next probe, at least 1 s).
        retry_after: Duration,
    },
}

/// What became of a call that missed its deadline: the request could not
/// wait, but the call may go on and the store answer after all. An answer
/// that arrives proves the store alive (the wait may have been this
/// instance's own: a starved CPU), which the failure policy needs to know
/// before it blames the store.
#[derive(Debug)]
pub struct Late(Option<tokio::sync::oneshot::Receiver<bool>>);

impl Late {
    /// A call that was dropped at the deadline: nobody will know.
    pub fn unknown() -> Self {
        Self(None)
    }

    /// A call going on, whose outcome `answered` will be sent.
    pub fn pending() -> (tokio::sync::oneshot::Sender<bool>, Self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (tx, Self(Some(rx)))
    }

    /// Whether the call goes on, so that its outcome will be known.
    pub fn is_pending(&self) -> bool {
        self.0.is_some()
    }

    /// Whether the store answered after all (false for a call dropped, or
    /// failed, or not answered within its allowance).
    pub async fn answered(self) -> bool {
        match self.0 {
            Some(rx) => rx.await.unwrap_or(false),
            None => false,
        }
    }
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
            StoreError::Deadline(_) => "deadline",
            StoreError::Unavailable { .. } => "unavailable",
        }
    }
}

/// Every label [`StoreError::kind`] can return: the bounded label set of
/// `ratelimit_store_errors_total{kind}`, `ratelimit_redis_errors_total{kind}`
/// and `/readyz`'s `error` (docs/observability.md lists them all).
pub const KINDS: &[&str] = &[
    "cost_exceeds_burst",
    "unsupported_algorithm",
    "deadline",
    "unavailable",
    "timeout",
    "connection_refused",
    "connection_dropped",
    "tls",
    "io",
    "cluster",
    "loading",
    "noscript",
    "readonly",
    "oom",
    "auth",
    "noperm",
    "server",
    "response",
    "client",
];

/// Classifies a Redis error into one bounded metric label. Order matters:
/// a timeout is also an I/O error, and a refusal is also a dropped
/// connection; a TLS failure is an I/O error with rustls's error inside.
///
/// What the operator must tell apart gets its own label: `oom` (Redis at
/// `maxmemory` with `noeviction`: free memory or raise the limit), `auth`
/// (no password or a wrong one: the URL's credentials), `noperm` (the ACL
/// user may not run a command the service sends, or touch its keys: the
/// ACL, see docs/redis.md, "The minimal ACL"), `tls` (the handshake or a
/// certificate). Any other error the server sent is `server`; `client`
/// is left for errors the client library raised itself.
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
            ErrorKind::Server(ServerErrorKind::NoPerm) => "noperm",
            ErrorKind::AuthenticationFailed => "auth",
            // Codes the redis crate does not know: OOM, NOAUTH, WRONGPASS
            // among them. Still the server's answer, never a client bug.
            ErrorKind::Extension => match e.code() {
                Some("OOM") => "oom",
                Some("NOAUTH" | "WRONGPASS") => "auth",
                Some("NOPERM") => "noperm",
                _ => "server",
            },
            ErrorKind::Server(ServerErrorKind::ResponseError) => {
                e.detail().and_then(refused_in_script).unwrap_or("server")
            }
            ErrorKind::Server(_) => "server",
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType => "response",
            _ => "client",
        }
    }
}

/// A command a script ran, refused: Redis answers the script's caller with
/// a plain `ERR`, the refusal in its text. Redis 7.0 words an ACL refusal
/// "The user executing the script can't run this command ..." (or "can't
/// access at least one of the keys ..."), Redis 7.2 and Valkey "ACL failure
/// in script: ...", and Redis 6 wraps the inner error ("NOPERM ...", "-OOM
/// command not allowed ...") in "Error running script ...".
fn refused_in_script(detail: &str) -> Option<&'static str> {
    if detail.contains("OOM command not allowed") {
        Some("oom")
    } else if detail.contains("ACL failure in script")
        || detail.contains("user executing the script can't")
        || detail.contains("NOPERM")
    {
        Some("noperm")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::redis::{ErrorKind, RedisError, ServerErrorKind, make_extension_error};

    fn err_reply(detail: &str) -> RedisError {
        RedisError::from((
            ErrorKind::Server(ServerErrorKind::ResponseError),
            "An error was signalled by the server",
            detail.to_owned(),
        ))
    }

    /// The replies the real servers send (tests/redis_access.rs meets them
    /// on a real redis-server; these are the other versions' wordings).
    #[test]
    fn refusals_are_told_apart_by_their_code_or_text() {
        let cases: [(RedisError, &str); 10] = [
            (
                make_extension_error(
                    "OOM".into(),
                    Some("command not allowed when used memory > 'maxmemory'.".into()),
                ),
                "oom",
            ),
            (
                make_extension_error("NOAUTH".into(), Some("Authentication required.".into())),
                "auth",
            ),
            (
                make_extension_error(
                    "WRONGPASS".into(),
                    Some("invalid username-password pair or user is disabled.".into()),
                ),
                "auth",
            ),
            (
                RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "Password authentication failed",
                )),
                "auth",
            ),
            (
                RedisError::from((
                    ErrorKind::Server(ServerErrorKind::NoPerm),
                    "this user has no permissions to run the 'evalsha' command",
                )),
                "noperm",
            ),
            // Redis 7.2 and Valkey, a script's command refused.
            (
                err_reply(
                    "ACL failure in script: User rl has no permissions to run the 'set' command script: on @user_script:1.",
                ),
                "noperm",
            ),
            // Redis 6, the same, and out of memory.
            (
                err_reply(
                    "Error running script (call to f_0123): @user_script:1: @user_script: 1: The user executing the script can't run this command or subcommand",
                ),
                "noperm",
            ),
            (
                err_reply(
                    "Error running script (call to f_0123): @user_script:1: -OOM command not allowed when used memory > 'maxmemory'.",
                ),
                "oom",
            ),
            // Other server errors stay `server`, whatever their code.
            (
                err_reply("wrong number of arguments for 'evalsha' command"),
                "server",
            ),
            (
                make_extension_error(
                    "BUSY".into(),
                    Some("Redis is busy running a script.".into()),
                ),
                "server",
            ),
        ];
        for (e, kind) in cases {
            assert_eq!(redis_error_kind(&e), kind, "{e}");
            assert!(KINDS.contains(&kind));
        }
        let client = RedisError::from((ErrorKind::Client, "cluster connect task failed"));
        assert_eq!(redis_error_kind(&client), "client");
    }

    /// The metrics table (docs/observability.md) and the Redis runbook name
    /// every label.
    #[test]
    fn every_kind_is_documented() {
        let root = env!("CARGO_MANIFEST_DIR");
        let docs = std::fs::read_to_string(format!("{root}/docs/observability.md")).unwrap();
        let row = docs
            .lines()
            .find(|l| l.starts_with("| `ratelimit_store_errors_total`"))
            .expect("the metrics table has a store errors row");
        let runbook = std::fs::read_to_string(format!("{root}/runbooks/redis-down.md")).unwrap();
        // `unavailable` is the failure policy's own answer, made above the
        // count; the refusals of a request never reach Redis.
        let counted = KINDS.iter().filter(|k| **k != "unavailable");
        for kind in counted.clone() {
            assert!(
                row.contains(&format!("`{kind}`")),
                "docs/observability.md metrics table: {kind}"
            );
        }
        let from_redis =
            counted.filter(|k| !["cost_exceeds_burst", "unsupported_algorithm"].contains(k));
        for kind in from_redis {
            assert!(
                runbook.contains(&format!("`{kind}`")),
                "runbooks/redis-down.md: {kind}"
            );
        }
    }
}
