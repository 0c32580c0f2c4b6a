//! One Redis call, observed where it happens: its duration and errors by
//! the node that served it (`ratelimit_redis_call_duration_seconds`,
//! `ratelimit_redis_errors_total`) and a client span with the node's
//! address and the key's slot.
//!
//! A call that misses the check's deadline goes on for the rest of the
//! Redis response timeout (see `failover::Deadline`) and is recorded as
//! whatever it became: answered (with its whole, late, duration) or
//! failed. One dropped mid-flight (past that allowance, or its request
//! gone) is recorded then, as `deadline`.

use super::topology::{Node, Topology};
use crate::metrics as m;
use crate::store::redis_error_kind;
use crate::telemetry::TARGET;
use redis::RedisError;
use std::sync::Arc;
use tracing::Span;

/// A call in flight. See the module docs.
pub(super) struct Call {
    node: Arc<Node>,
    script: &'static str,
    /// quanta's counter, as `Limiter::decide` times a check: a TSC read
    /// and a scaling rather than two `clock_gettime`s, for a duration that
    /// is all it is used for.
    started: quanta::Instant,
    span: Span,
    done: bool,
}

impl Call {
    /// A call of `operation` (`EVALSHA`, `GET`, ...) to `node` (with the
    /// key's slot in a cluster: [`Topology::node`]), labelled `script`,
    /// starting now.
    pub(super) fn start(
        (node, slot): (Arc<Node>, Option<u16>),
        operation: &'static str,
        script: &'static str,
    ) -> Self {
        let span = tracing::info_span!(
            target: TARGET,
            "redis",
            otel.name = operation,
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            db.system.name = "redis",
            db.operation.name = operation,
            db.redis.script = script,
            server.address = &*node.host,
            server.port = node.port,
            db.redis.slot = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        if let Some(slot) = slot {
            span.record("db.redis.slot", slot);
        }
        Self {
            node,
            script,
            started: quanta::Instant::now(),
            span,
            done: false,
        }
    }

    /// The call's span, to run the call in.
    pub(super) fn span(&self) -> Span {
        self.span.clone()
    }

    fn record(&self, error: Option<&'static str>) {
        let node = &self.node;
        node.durations
            .get(
                self.script,
                || self.script,
                || {
                    metrics::histogram!(
                        m::REDIS_CALL_DURATION_SECONDS,
                        "node" => Arc::clone(&node.label),
                        "script" => self.script,
                    )
                },
            )
            .record(self.started.elapsed().as_secs_f64());
        if let Some(kind) = error {
            node.errors
                .get(
                    kind,
                    || kind,
                    || {
                        metrics::counter!(
                            m::REDIS_ERRORS_TOTAL,
                            "node" => Arc::clone(&node.label),
                            "kind" => kind,
                        )
                    },
                )
                .increment(1);
            self.span.record("error.type", kind);
            self.span.record("otel.status_code", "ERROR");
        }
    }

    /// The call answered (or failed): record it. A cluster error may mean
    /// a slot moved, so the slot map is re-read.
    pub(super) fn finish<T>(mut self, result: &Result<T, RedisError>, topology: &Topology) {
        self.done = true;
        let kind = result.as_ref().err().map(redis_error_kind);
        if kind == Some("cluster") {
            topology.stale();
        }
        self.record(kind);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.done {
            // Dropped in flight: past the deadline's allowance for a late
            // answer (or the request went away).
            self.record(Some("deadline"));
        }
    }
}
