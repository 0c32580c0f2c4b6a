//! What the limiter does when its shared store misbehaves: store wrappers
//! for a deadline ([`Deadline`]) and a circuit breaker with failure modes
//! ([`Failover`]), stacked around the Redis store in `server.rs`.
//!
//! A limiter that stalls or vanishes with Redis is worse than none. Every
//! Redis check has a deadline (default 10 ms, against a loopback round trip
//! of ~0.1 ms): a request never waits on Redis longer than that. A check
//! that fails or misses it is decided by the policy's failure mode (carried
//! by the [`Check`]), and so is every check while its node's [`Breaker`]
//! is open (after repeated failures nobody calls that node for a cooldown;
//! then one probe does). There is a breaker per Redis node: in a cluster a
//! dead master sends only the keys of its slots to the failure mode, and
//! the other masters' keys stay exact; when its replica takes the slots
//! over, that node's own breaker (closed) takes the keys back.
//!
//! | mode | while Redis is away | the risk it takes |
//! |---|---|---|
//! | `open` | admit, no rate headers | knocking Redis over removes the limit |
//! | `closed` | 503 + `Retry-After` (the client is not at fault) | a Redis blip is an outage |
//! | `local` (default) | each instance enforces its share of the limit in memory | the fleet's admission is bounded near the limit if traffic is spread evenly |
//!
//! # The local share ([`LocalShare`])
//! With `instances` = N expected instances, a local bucket holds
//! `max(burst / N, cost, 1)` tokens and refills at `rate / N`: N instances
//! behind a balancer admit about the policy's limit between them. Fewer
//! instances than N admit less (safe side); uneven balancing too.
//!
//! # Taking over without a fresh burst
//! Every answer from Redis also sets this instance's local bucket for the
//! client (one in-memory write beside a network round trip): a bucket
//! policy's to the same time until full, a window policy's to the same
//! fraction of room left (a window's "reset" is when its count clears, not a
//! refill). When Redis goes away, the local shares start where the shared
//! state was, not full: a client that had just spent its burst cannot spend
//! another N shares of it.
//!
//! # Handing back without a fresh burst
//! When Redis returns, its bucket for a client is either refilled (it kept
//! its data while unreachable) or absent (restarted empty), which reads as
//! full: the client, having spent its local share, would get a second whole
//! burst. That holds whatever the failure mode (fail-open and fail-closed
//! leave the mirrored bucket as it was, refilling as one bucket would) and
//! for a client that sent nothing meanwhile. So after any fallback, while a
//! client's local bucket is not yet full again, each Redis check carries a
//! ceiling ([`Check::ceiling`]): the shared
//! level that would be full again when the local bucket is. For a client
//! that only ever mirrored Redis that is Redis's own level (so it never
//! binds); for one that spent its local share it is what the fallback left.
//! Once the local bucket is full the ceiling has nothing left to say.
//!
//! The local share is a token bucket whatever the policy's algorithm, and
//! the ceiling is a bucket level, so only token-bucket policies are handed
//! back with one; other algorithms' shared state restarts empty after a
//! Redis restart (a fresh window).

mod breaker;
mod deadline;
mod local;
mod recent;

pub use breaker::{Breaker, BreakerState, Permit, Transition};
pub use deadline::Deadline;
pub use local::{LocalShare, share, try_share};
pub use recent::{Recent, RecentShare};

use crate::clock::Micros;
use crate::metrics as m;
use crate::store::{Check, CheckFuture, Checked, FailureMode, Layer, Source, Store, StoreError};
use crate::telemetry::TARGET;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The failure policy's settings (validated config; the defaults are the
/// config's, in `config/file.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailoverSettings {
    /// The mode of policies that do not set their own.
    pub mode: FailureMode,
    /// The longest a request waits on the shared store.
    pub deadline: Duration,
    /// How many instances share the limit (the local share is 1/N).
    pub instances: u64,
    /// Consecutive failures that open the breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open before probing.
    pub breaker_cooldown: Duration,
}

/// The window [`BreakerHandle::recent`] reports on: long enough to see a
/// breaker that flaps (opening, probing, closing and opening again every
/// cooldown), short enough that readiness recovers soon after Redis does.
pub const RECENT_WINDOW: Duration = Duration::from_secs(10);

/// The share of recent checks decided by the failure mode from which
/// `/readyz` calls an instance degraded although the breaker is closed and
/// Redis answers a PING. It sits well above what deadline misses decide on
/// a quiet instance and well below what a CPU-starved instance or a
/// flapping breaker sends to the fallback (measured in docs/failover.md);
/// at 5 % a client already meets the local share's smaller limit one
/// request in twenty.
pub const DEGRADED_SHARE: f64 = 0.05;

/// A shared handle on a [`Failover`]'s breakers, one per Redis node: what
/// `/readyz` and `/metrics` report.
#[derive(Debug, Clone)]
pub struct BreakerHandle {
    shared: Arc<BreakerCell>,
}

#[derive(Debug)]
struct BreakerCell {
    nodes: Mutex<Nodes>,
    /// The checks of the last [`RECENT_WINDOW`], and who decided them.
    recent: Mutex<Recent>,
    /// The breakers' clock: monotonic, so a wall clock stepping back cannot
    /// hold one open (bucket state uses the wall clock `now`, shared with
    /// other instances; the breakers are this process's alone).
    epoch: tokio::time::Instant,
}

/// The breakers by node, and how to make one for a node seen first.
#[derive(Debug)]
struct Nodes {
    list: Vec<NodeBreaker>,
    failures: u32,
    cooldown: Duration,
    /// Whether the nodes change (a cluster's slots move, its masters fail
    /// over): a breaker its node no longer serves is then forgotten.
    moving: bool,
}

#[derive(Debug)]
struct NodeBreaker {
    node: Arc<str>,
    breaker: Breaker,
    /// When a check last went to (or was kept from) this node.
    seen: Micros,
}

impl Nodes {
    /// `node`'s breaker, made closed if it has none yet.
    fn get(&mut self, node: &Arc<str>, now: Micros) -> &mut NodeBreaker {
        let at = match self
            .list
            .iter()
            .position(|n| Arc::ptr_eq(&n.node, node) || n.node == *node)
        {
            Some(at) => at,
            None => {
                self.forget(now);
                gauge_state(node, BreakerState::Closed);
                self.list.push(NodeBreaker {
                    node: Arc::clone(node),
                    breaker: Breaker::new(self.failures, self.cooldown),
                    seen: now,
                });
                self.list.len() - 1
            }
        };
        let entry = &mut self.list[at];
        entry.seen = now;
        entry
    }

    /// Drops the breakers of nodes no check went to for a
    /// [`RECENT_WINDOW`]: in a cluster, a master that failed over or lost
    /// its slots (its breaker would otherwise read open for ever). A node
    /// that was only quiet loses a closed breaker, or an open one that a
    /// check to it would soon open again.
    fn forget(&mut self, now: Micros) {
        if !self.moving {
            return;
        }
        let window = u64::try_from(RECENT_WINDOW.as_micros()).unwrap_or(u64::MAX);
        self.list.retain(|n| {
            let keep = now.saturating_sub(n.seen) < window;
            if !keep {
                gauge_state(&n.node, BreakerState::Closed);
            }
            keep
        });
        self.gauge_active();
    }

    /// The worst state of any node's breaker.
    fn worst(&self) -> BreakerState {
        self.list
            .iter()
            .map(|n| n.breaker.state())
            .max_by(|a, b| a.gauge().total_cmp(&b.gauge()))
            .unwrap_or(BreakerState::Closed)
    }

    fn gauge_active(&self) {
        let active = self.worst() != BreakerState::Closed;
        metrics::gauge!(m::FALLBACK_ACTIVE).set(if active { 1.0 } else { 0.0 });
    }
}

fn gauge_state(node: &Arc<str>, state: BreakerState) {
    metrics::gauge!(m::BREAKER_STATE, "node" => node.to_string()).set(state.gauge());
}

impl BreakerHandle {
    /// Breakers that open after `failures` consecutive failures of their
    /// node, for `cooldown`; `first` is the node of a store that has one
    /// (its breaker, closed, shown from the start), `None` for one whose
    /// nodes are learned as checks go to them.
    fn new(failures: u32, cooldown: Duration, first: Option<Arc<str>>) -> Self {
        metrics::gauge!(m::FALLBACK_ACTIVE).set(0.0);
        // At zero from the start, so a dashboard's rate shows 0, not no data.
        for outcome in ["answered", "failed"] {
            metrics::counter!(m::LATE_ANSWERS_TOTAL, "outcome" => outcome).increment(0);
        }
        let mut nodes = Nodes {
            list: Vec::new(),
            failures,
            cooldown,
            moving: first.is_none(),
        };
        if let Some(node) = &first {
            nodes.get(node, 0);
        }
        Self {
            shared: Arc::new(BreakerCell {
                nodes: Mutex::new(nodes),
                recent: Mutex::new(Recent::new(RECENT_WINDOW, 0)),
                epoch: tokio::time::Instant::now(),
            }),
        }
    }

    /// The worst state of any node's breaker now (closed when every node
    /// is called).
    pub fn state(&self) -> BreakerState {
        let now = self.monotonic();
        let mut nodes = self.lock();
        nodes.forget(now);
        nodes.worst()
    }

    /// The nodes whose breaker is not closed (their keys decided by the
    /// failure mode), with its state, in the order they were first seen.
    pub fn degraded(&self) -> Vec<(Arc<str>, BreakerState)> {
        let now = self.monotonic();
        let mut nodes = self.lock();
        nodes.forget(now);
        nodes
            .list
            .iter()
            .filter(|n| n.breaker.state() != BreakerState::Closed)
            .map(|n| (Arc::clone(&n.node), n.breaker.state()))
            .collect()
    }

    /// How much the failure mode decided over the last [`RECENT_WINDOW`],
    /// and how often a breaker opened.
    pub fn recent(&self) -> RecentShare {
        let now = self.monotonic();
        self.lock().forget(now);
        self.lock_recent().share(now)
    }

    fn lock_recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.shared
            .recent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A check that began `at` (its permit's reading: one clock read a
    /// check, and the window is seconds long) was decided by Redis, or
    /// (`fallback`) by the failure mode.
    fn decided(&self, at: Micros, fallback: bool) {
        self.lock_recent().decided(at, fallback);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Nodes> {
        self.shared
            .nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Microseconds on the breakers' monotonic clock.
    fn monotonic(&self) -> Micros {
        u64::try_from(self.shared.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether a check may call `node` now, and when now is.
    fn permit(&self, node: &Arc<str>) -> (Permit, Micros) {
        let now = self.monotonic();
        let mut nodes = self.lock();
        let (permit, transition) = nodes.get(node, now).breaker.permit(now);
        if let Some(t) = transition {
            record(&mut nodes, node, t);
        }
        (permit, now)
    }

    fn success(&self, node: &Arc<str>, permit: Permit) {
        let now = self.monotonic();
        let mut nodes = self.lock();
        if let Some(t) = nodes.get(node, now).breaker.success(permit) {
            record(&mut nodes, node, t);
        }
    }

    fn failure(&self, node: &Arc<str>, permit: Permit) {
        let now = self.monotonic();
        let mut nodes = self.lock();
        let transition = nodes.get(node, now).breaker.failure(permit, now);
        if let Some(t) = transition {
            if t.to == BreakerState::Open {
                self.lock_recent().opened(now);
            }
            record(&mut nodes, node, t);
        }
    }

    /// How long until `node`'s next probe may go out.
    fn wait(&self, node: &Arc<str>) -> Duration {
        let now = self.monotonic();
        self.lock().get(node, now).breaker.wait(now)
    }
}

/// A shared store wrapped in a circuit breaker and the failure modes, with
/// this instance's [`LocalShare`] mirrored beside it. A store itself: put a
/// [`Deadline`] under it, so that a hung store fails instead of waiting.
#[derive(Debug)]
pub struct Failover<S> {
    inner: S,
    breaker: BreakerHandle,
    local: LocalShare,
    /// Whether checks carry the hand-back ceiling (always, but for the
    /// tests that show what it prevents).
    hand_back: bool,
    /// The node of a store that has one; `None` in a cluster.
    one_node: Option<Arc<str>>,
}

impl<S> Failover<S> {
    /// Wraps `inner`, with the breaker and the local share `settings` and
    /// `local` describe.
    pub fn new(inner: S, settings: &FailoverSettings, local: LocalShare) -> Self
    where
        S: Store,
    {
        // One node (a standalone Redis): its breaker from the start. A
        // cluster's nodes are learned from the slot map as checks go.
        let one_node = inner.one_node();
        let first = one_node.then(|| {
            inner
                .slot_owner(0)
                .unwrap_or_else(|| Arc::from(inner.backend()))
        });
        Self {
            inner,
            breaker: BreakerHandle::new(
                settings.breaker_failures,
                settings.breaker_cooldown,
                first.clone(),
            ),
            local,
            hand_back: true,
            one_node: first,
        }
    }

    /// The node `check`'s bucket lives on: the one node, or its slot's
    /// master in a cluster.
    fn node(&self, check: &Check) -> Arc<str>
    where
        S: Store,
    {
        match &self.one_node {
            Some(node) => Arc::clone(node),
            None => self
                .inner
                .slot_owner(check.key.slot())
                .unwrap_or_else(|| Arc::from(self.inner.backend())),
        }
    }

    /// The same wrapper without the hand-back ceiling: a broken build, for
    /// the tests that show what the ceiling prevents (a fresh burst from a
    /// restarted Redis). Never used by the service.
    #[doc(hidden)]
    pub fn without_hand_back_ceiling(self) -> Self {
        Self {
            hand_back: false,
            ..self
        }
    }

    /// A handle on the breakers (their states, for `/readyz`).
    pub fn breaker(&self) -> BreakerHandle {
        self.breaker.clone()
    }

    /// Decides `check` by its failure mode, without the shared store.
    fn fall_back(&self, check: &Check, node: &Arc<str>) -> Result<Checked, StoreError> {
        match check.on_failure {
            FailureMode::Open => Ok(Checked {
                decision: None,
                limit: check.limit,
                source: Source::FailOpen,
                bounded: false,
                shard: None,
                extra: 0,
            }),
            FailureMode::Closed => Err(StoreError::Unavailable {
                retry_after: self.breaker.wait(node).max(Duration::from_secs(1)),
            }),
            FailureMode::Local => self.local.decide(check),
        }
    }
}

impl<S: Store> Layer for Failover<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        CheckFuture::waiting(async move {
            let node = self.node(&check);
            let (permit, began) = self.breaker.permit(&node);
            if permit != Permit::Skip {
                let ceiling = match (
                    check.ceiling,
                    self.hand_back.then(|| self.local.ceiling(&check)).flatten(),
                ) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                match self.inner.check(check.with_ceiling(ceiling)).await {
                    Ok(checked) => {
                        self.breaker.success(&node, permit);
                        self.breaker.decided(began, false);
                        if let Some(decision) = &checked.decision {
                            self.local.mirror(&check, decision);
                        }
                        return Ok(Checked {
                            bounded: checked.bounded || ceiling.is_some(),
                            ..checked
                        });
                    }
                    // The request itself is at fault, not the store (which
                    // answered, so a probe has its answer).
                    Err(e) if e.is_request_error() => {
                        self.breaker.success(&node, permit);
                        return Err(e);
                    }
                    // Too late for this request, but perhaps not for
                    // Redis: the breaker hears when the call ends (see
                    // `deadline`). A late answer is Redis alive; only a
                    // call that fails or outlasts its allowance counts
                    // against it.
                    Err(StoreError::Deadline(late)) if late.is_pending() => {
                        tracing::debug!(?permit, %node, "redis check missed the deadline");
                        let breaker = self.breaker.clone();
                        let node = Arc::clone(&node);
                        tokio::spawn(async move {
                            let answered = late.answered().await;
                            metrics::counter!(
                                m::LATE_ANSWERS_TOTAL,
                                "outcome" => if answered { "answered" } else { "failed" },
                            )
                            .increment(1);
                            if answered {
                                breaker.success(&node, permit);
                            } else {
                                breaker.failure(&node, permit);
                            }
                        });
                    }
                    Err(e) => {
                        tracing::debug!(kind = e.kind(), ?permit, %node, "redis check failed");
                        self.breaker.failure(&node, permit);
                    }
                }
            } else {
                // On the check's span: Redis was not asked at all.
                tracing::info!(
                    target: TARGET,
                    %node,
                    "redis skipped: the node's circuit breaker is open"
                );
            }
            self.breaker.decided(began, true);
            self.local.fell_back();
            self.fall_back(&check, &node)
        })
    }
}

/// `node`'s breaker went from one state to another: its metrics and a log
/// line (`nodes` held, so the gauges agree with the states).
fn record(nodes: &mut Nodes, node: &Arc<str>, t: Transition) {
    metrics::counter!(
        m::BREAKER_TRANSITIONS_TOTAL,
        "node" => node.to_string(),
        "from" => t.from.as_str(),
        "to" => t.to.as_str(),
    )
    .increment(1);
    gauge_state(node, t.to);
    nodes.gauge_active();
    match t.to {
        BreakerState::Open if t.from == BreakerState::Closed => {
            tracing::warn!(%node, "redis circuit breaker open: deciding the node's keys by the failure mode");
        }
        BreakerState::Open => tracing::debug!(%node, "redis probe failed: breaker open again"),
        BreakerState::HalfOpen => tracing::info!(%node, "redis circuit breaker half-open: probing"),
        BreakerState::Closed => {
            tracing::info!(%node, "redis circuit breaker closed: redis decides again");
        }
    }
}

#[cfg(test)]
mod tests;
