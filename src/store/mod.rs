//! Where limit state lives, behind one narrow trait, and the request and
//! answer that flow through every layer of the store stack.
//!
//! A store answers one question, asked as a [`Check`]: "decide `cost` for
//! bucket `key` under `limit` at `now`". It does not pick keys, read clocks
//! or shape responses; those belong to the limiter and the middleware.
//!
//! Stores stack the way tower layers do: a wrapper holds a store and is a
//! [`Layer`], so a [`Store`] itself, and the layers are assembled in one
//! place at start-up (`server.rs`) and each stays a room of its own:
//!
//! ```text
//! Sharded<DenyCache<Leases<Failover<Counted<Deadline<LuaStore>>>>>>   (backend lua or naive)
//! Sharded<DenyCache<Leases<Counted<MemoryStore>>>>                    (backend memory)
//! ```
//!
//! - [`MemoryStore`], [`LuaStore`], [`NaiveStore`]: the backends;
//! - [`Counted`]: counts every error of what it wraps, by kind: the one
//!   place store errors are counted;
//! - [`crate::failover`]: the deadline per call, and the circuit breaker
//!   with the failure modes and the local share.
//!
//! The trait is object safe so the stack can be chosen at start-up from
//! the config and held as `Arc<dyn Store>`. A check returns a
//! [`CheckFuture`]: the answer itself when a layer has it at once, a boxed
//! future only for one that waits on the network.

mod counted;
mod error;
pub mod memory;
pub mod redis;

pub use crate::key::BucketKey;
pub use counted::Counted;
pub use error::{KINDS, Late, StoreError, redis_error_kind};
pub use memory::MemoryStore;
pub use redis::{LuaStore, NaiveStore};

use crate::algorithm::token_bucket::TakeUpTo;
use crate::algorithm::{Algorithm, Decision, Limit};
use crate::clock::Micros;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// A boxed, sendable future, as returned by [`Store::ready`] (and held by
/// a [`CheckFuture`] that waits).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a check comes to.
pub type CheckResult = Result<Checked, StoreError>;

/// What [`Store::check`] returns: the answer, when the store has it at
/// once, or a boxed future for one that waits (a round trip to Redis).
///
/// Why not a boxed future always: an in-process check, a deny-cache hit
/// and a spent lease are answered without waiting, and a box per layer of
/// the stack would be an allocation per layer on every one of them. A
/// wrapper adds its step with [`CheckFuture::map`], which runs it at once
/// on an answer that is here and boxes only around one that is not; a
/// wrapper that only looks at the answer ([`Observe`], as the error count
/// does) adds itself with [`CheckFuture::observe`], which boxes nothing:
/// the future keeps one such onlooker beside its answer.
#[must_use = "a check's answer is lost unless awaited"]
pub struct CheckFuture<'a> {
    answer: Answer<'a>,
    /// Shown the answer when it comes, before it is returned.
    onlooker: Option<&'a dyn Observe>,
}

/// A store layer that looks at each answer and leaves it as it is (see
/// [`CheckFuture::observe`]).
pub trait Observe: Sync {
    /// Sees `result` on its way up.
    fn observe(&self, result: &CheckResult);
}

enum Answer<'a> {
    /// Here; taken by the poll that returns it.
    Ready(Option<CheckResult>),
    Waiting(BoxFuture<'a, CheckResult>),
}

impl<'a> CheckFuture<'a> {
    /// An answer that is here.
    pub fn ready(result: CheckResult) -> Self {
        Self {
            answer: Answer::Ready(Some(result)),
            onlooker: None,
        }
    }

    /// An answer still to come from `future`.
    pub fn waiting(future: impl Future<Output = CheckResult> + Send + 'a) -> Self {
        Self {
            answer: Answer::Waiting(Box::pin(future)),
            onlooker: None,
        }
    }

    /// Whether the answer is here (awaiting it will not wait).
    pub fn is_ready(&self) -> bool {
        matches!(self.answer, Answer::Ready(_))
    }

    /// `step` applied to the answer: now, if it is here; else when it
    /// comes.
    pub fn map(self, step: impl FnOnce(CheckResult) -> CheckResult + Send + 'a) -> Self {
        match self {
            Self {
                answer: Answer::Ready(Some(result)),
                onlooker: None,
            } => Self::ready(step(result)),
            Self {
                answer: Answer::Ready(None),
                ..
            } => self,
            // Waiting, or an onlooker to show the answer first.
            waiting => Self::waiting(async move { step(waiting.await) }),
        }
    }

    /// The answer shown to `onlooker` as it passes: now, if it is here;
    /// else when it comes, with no box of its own (unless an onlooker is
    /// already waiting for it).
    pub fn observe(self, onlooker: &'a dyn Observe) -> Self {
        match self {
            Self {
                answer: answer @ Answer::Waiting(_),
                onlooker: None,
            } => Self {
                answer,
                onlooker: Some(onlooker),
            },
            // Here (shown now), or the slot taken (boxed).
            other => other.map(move |result| {
                onlooker.observe(&result);
                result
            }),
        }
    }
}

impl Future for CheckFuture<'_> {
    type Output = CheckResult;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<CheckResult> {
        let this = self.get_mut();
        let result = match &mut this.answer {
            Answer::Ready(result) => result.take().expect("CheckFuture polled after completion"),
            Answer::Waiting(future) => std::task::ready!(future.as_mut().poll(cx)),
        };
        if let Some(onlooker) = this.onlooker.take() {
            onlooker.observe(&result);
        }
        Poll::Ready(result)
    }
}

impl fmt::Debug for CheckFuture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CheckFuture")
            .field(&if self.is_ready() { "ready" } else { "waiting" })
            .finish()
    }
}

/// What a policy does while its shared store cannot decide. Carried by
/// every [`Check`]; acted on by [`crate::failover::Failover`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Admit (and say so in the metrics).
    Open,
    /// Refuse with 503 and `Retry-After`.
    Closed,
    /// Enforce this instance's share of the limit in memory (the default).
    #[default]
    Local,
}

impl FailureMode {
    /// The name used in config and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
            FailureMode::Local => "local",
        }
    }
}

/// One request to a store: everything a layer of the stack may need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// The bucket.
    pub key: BucketKey,
    /// The limit, with the algorithm that enforces it.
    pub limit: Limit,
    /// Tokens the request costs.
    pub cost: u64,
    /// The instant to decide at (never read from a clock by a store).
    pub now: Micros,
    /// What the failure policy does if the shared store cannot decide.
    pub on_failure: FailureMode,
    /// At most this many units in a token bucket after refill (`None`: no
    /// bound): how the failure policy hands a bucket back from its local
    /// share without a fresh burst (see
    /// [`crate::algorithm::token_bucket::check_within`]).
    pub ceiling: Option<u64>,
    /// Whether a deny cache above may answer this check from a denial it
    /// holds (the policy's `deny_cache`).
    pub deny_cache: bool,
    /// Tokens a lease layer above may take at most with a call for this
    /// key (the policy's `lease`; 0: no leases).
    pub lease: u64,
    /// Sub-buckets a shard layer above splits this key over (the policy's
    /// `shards`, for the keys it applies to; 0 or 1: not split).
    pub shards: u16,
    /// Whole tokens to take beyond the cost, in the same step, if the
    /// bucket has them (a token bucket's lease; `None`: the cost alone).
    /// The answer says how many were taken ([`Checked::extra`]).
    pub take: Option<TakeUpTo>,
}

impl Check {
    /// A check of `cost` for `key` under `limit` at `now`, failing over to
    /// the local share, with no ceiling.
    pub fn new(key: BucketKey, limit: Limit, cost: u64, now: Micros) -> Self {
        Self {
            key,
            limit,
            cost,
            now,
            on_failure: FailureMode::default(),
            ceiling: None,
            deny_cache: false,
            lease: 0,
            shards: 1,
            take: None,
        }
    }

    /// The same check with another failure mode.
    pub fn on_failure(self, on_failure: FailureMode) -> Self {
        Self { on_failure, ..self }
    }

    /// The same check, leasing `lease` tokens at a time (0: not).
    pub fn with_lease(self, lease: u64) -> Self {
        Self { lease, ..self }
    }

    /// The same check, split over `shards` sub-buckets (1: not).
    pub fn with_shards(self, shards: u16) -> Self {
        Self { shards, ..self }
    }

    /// The same check, answerable by a deny cache or not.
    pub fn with_deny_cache(self, deny_cache: bool) -> Self {
        Self { deny_cache, ..self }
    }

    /// The same check, taking up to `take.extra` tokens more if it can.
    pub fn taking(self, take: TakeUpTo) -> Self {
        Self {
            take: Some(take),
            ..self
        }
    }

    /// The same check bounded by `ceiling` (units).
    pub fn with_ceiling(self, ceiling: Option<u64>) -> Self {
        Self { ceiling, ..self }
    }
}

/// Who decided a request (the `source` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The shared store (Redis).
    Redis,
    /// The in-process store, as the configured backend.
    Memory,
    /// This instance's share, while Redis is away.
    Local,
    /// Nobody: admitted because Redis is away and the mode is `open`.
    FailOpen,
    /// This instance's deny cache: the store denied this key, and that
    /// denial still holds.
    DenyCache,
    /// Tokens this instance leased from the shared bucket.
    Lease,
}

impl Source {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Redis => "redis",
            Source::Memory => "memory",
            Source::Local => "local",
            Source::FailOpen => "failopen",
            Source::DenyCache => "deny_cache",
            Source::Lease => "lease",
        }
    }
}

/// What a store answers: the one result type of every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// The decision; `None` when failing open (admitted, nothing counted).
    pub decision: Option<Decision>,
    /// The limit the decision applied (the local share when `Local`).
    pub limit: Limit,
    /// Who decided.
    pub source: Source,
    /// The decision was bounded by a hand-back ceiling
    /// ([`Check::ceiling`]): stricter than the shared bucket alone, and only
    /// for as long as the local share lags, so not a fact to remember.
    pub bounded: bool,
    /// The sub-bucket that decided, when the key is sharded
    /// ([`Check::shards`]): the bucket the store was called for.
    pub shard: Option<BucketKey>,
    /// Whole tokens taken beyond the cost ([`Check::take`]); 0 for a check
    /// that asked none, and whenever the store granted none.
    pub extra: u64,
}

impl Checked {
    /// `decision` under `limit`, made by `source`.
    pub fn decided(decision: Decision, limit: Limit, source: Source) -> Self {
        Self {
            decision: Some(decision),
            limit,
            source,
            bounded: false,
            shard: None,
            extra: 0,
        }
    }
}

/// Limit state, local or shared. Every layer of the stack is one.
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Decide `check`, and record the spend if admitted. A store that can
    /// answer at once decides (and spends, learns, counts) when called,
    /// and returns the answer ready; one that waits does its work when
    /// polled.
    fn check(&self, check: Check) -> CheckFuture<'_>;

    /// [`Store::check`] on a store held by an `Arc`, its answer owning the
    /// store, so that it can outlive the call (the deadline hands a late
    /// call on to a task of its own). The default boxes the borrowing
    /// future once more; a store on the hot path (`LuaStore`) answers its
    /// own owning future instead, which spares the deadline a box and a
    /// layer of polling a check. Like [`Store::check`] for a store that
    /// waits, it does its work only when polled.
    fn check_owned(self: Arc<Self>, check: Check) -> CheckFuture<'static> {
        CheckFuture::waiting(async move { self.check(check).await })
    }

    /// The longest a check can wait on this store, when something bounds
    /// it: `Some(ZERO)` for a store that answers when called, the deadline
    /// for one under a [`crate::failover::Deadline`], and `None` (the
    /// default, always safe) when nothing below is known to. The front
    /// service spares a check bounded within the request timeout its own
    /// timer.
    fn longest_wait(&self) -> Option<Duration> {
        None
    }

    /// The backend's name, as used in metric labels and logs.
    fn backend(&self) -> &'static str;

    /// Whether the store can decide right now (for `/readyz`).
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    /// The node serving cluster `slot` now (`host:port`), for a store that
    /// keeps its state on Redis nodes; `None` for one that keeps it in this
    /// process.
    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        let _ = slot;
        None
    }

    /// Whether every slot is on one node, and stays there: this process,
    /// or a standalone Redis (a Cluster's slots are on several nodes, and
    /// move). The hot-key detector then counts no slots: on one node a
    /// key's share is of all the store's calls, and a check spares its
    /// key's CRC16. The default, one node when no node is named, is right
    /// for a store in this process.
    fn one_node(&self) -> bool {
        self.slot_owner(0).is_none()
    }
}

/// A store that wraps another: it decides checks its own way and answers
/// every other question with its inner store's, overriding only
/// [`Layer::longest_wait`] when it changes the bound. Every wrapper of the
/// stack is a `Layer` rather than a [`Store`] of its own, so none can
/// forget to pass `/readyz`'s question or a slot's owner on: the one
/// blanket `impl Store` below forwards them all (`tests/architecture.rs`
/// refuses a wrapper that implements [`Store`] by hand).
pub trait Layer: Send + Sync + fmt::Debug + 'static {
    /// The store this layer wraps.
    type Inner: Store;

    /// The wrapped store.
    fn inner(&self) -> &Self::Inner;

    /// [`Store::check`] through this layer.
    fn check_through(&self, check: Check) -> CheckFuture<'_>;

    /// [`Store::longest_wait`] through this layer: the inner store's,
    /// unless the layer bounds it (a deadline).
    fn longest_wait(&self) -> Option<Duration> {
        self.inner().longest_wait()
    }
}

impl<L: Layer> Store for L {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        self.check_through(check)
    }

    fn longest_wait(&self) -> Option<Duration> {
        Layer::longest_wait(self)
    }

    fn backend(&self) -> &'static str {
        self.inner().backend()
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner().ready()
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        self.inner().slot_owner(slot)
    }

    fn one_node(&self) -> bool {
        self.inner().one_node()
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        (**self).check(check)
    }

    fn check_owned(self: Arc<Self>, check: Check) -> CheckFuture<'static> {
        Arc::clone(&*self).check_owned(check)
    }

    fn longest_wait(&self) -> Option<Duration> {
        (**self).longest_wait()
    }

    fn backend(&self) -> &'static str {
        (**self).backend()
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        (**self).ready()
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        (**self).slot_owner(slot)
    }

    fn one_node(&self) -> bool {
        (**self).one_node()
    }
}

/// Where limit state lives, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process: exact, fast, but each instance has its own buckets.
    Memory,
    /// Redis, GET/compute/SET: racy on purpose, the baseline to beat.
    Naive,
    /// Redis, one atomic Lua script per check.
    Lua,
}

impl Backend {
    /// The name used on the command line and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Naive => "naive",
            Backend::Lua => "lua",
        }
    }

    /// Whether its state is shared between instances (through Redis), so
    /// that a failure policy has something to fail over from.
    pub fn is_shared(self) -> bool {
        self != Backend::Memory
    }

    /// Whether this backend runs `algorithm` at all (asked of the
    /// algorithm's description; the stores refuse the same at run time).
    pub fn runs(self, algorithm: Algorithm) -> bool {
        match self {
            Backend::Memory => algorithm.max_packed_burst().is_some(),
            Backend::Naive => algorithm.has_naive_store(),
            Backend::Lua => true,
        }
    }

    /// The largest burst this backend keeps under `algorithm` (the
    /// in-process store's entries have room for so much).
    pub fn max_burst(self, algorithm: Algorithm) -> u64 {
        match self {
            Backend::Memory => algorithm.max_packed_burst().unwrap_or(0),
            Backend::Naive | Backend::Lua => u64::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn answer() -> CheckResult {
        Ok(decided())
    }

    fn decided() -> Checked {
        let limit = Limit::per_second(1, 1).unwrap();
        let decision = crate::algorithm::Decision {
            allowed: true,
            limit: 1,
            remaining: 0,
            retry_after: std::time::Duration::ZERO,
            reset: std::time::Duration::from_secs(1),
        };
        Checked::decided(decision, limit, Source::Memory)
    }

    /// A wrapper's step runs at once on an answer that is here (the answer
    /// stays here), and only when awaited on one still to come.
    #[tokio::test]
    async fn map_runs_a_step_now_or_when_the_answer_comes() {
        let steps = AtomicU32::new(0);
        let step = |result: CheckResult| {
            steps.fetch_add(1, Ordering::Relaxed);
            result.map(|c| Checked { bounded: true, ..c })
        };
        let ready = CheckFuture::ready(answer()).map(step);
        assert!(ready.is_ready());
        assert_eq!(steps.load(Ordering::Relaxed), 1);
        assert!(ready.await.unwrap().bounded);

        let waiting = CheckFuture::waiting(async {
            tokio::task::yield_now().await;
            answer()
        })
        .map(step);
        assert!(!waiting.is_ready());
        assert_eq!(steps.load(Ordering::Relaxed), 1);
        assert!(waiting.await.unwrap().bounded);
        assert_eq!(steps.load(Ordering::Relaxed), 2);
    }

    /// Counts the answers it is shown, and records what `before` had
    /// counted when it was.
    struct Onlooker<'a>(AtomicU32, Option<&'a Onlooker<'a>>, AtomicU32);

    impl Observe for Onlooker<'_> {
        fn observe(&self, result: &CheckResult) {
            assert!(result.is_ok());
            self.0.fetch_add(1, Ordering::Relaxed);
            if let Some(before) = self.1 {
                self.2
                    .store(before.0.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
    }

    /// An onlooker sees an answer that is here at once, and one still to
    /// come when it comes, once each; a second onlooker on the same
    /// waiting answer sees it too, and after the first.
    #[tokio::test]
    async fn onlookers_see_each_answer_once_now_or_when_it_comes() {
        let first = Onlooker(AtomicU32::new(0), None, AtomicU32::new(0));
        let second = Onlooker(AtomicU32::new(0), Some(&first), AtomicU32::new(0));
        let ready = CheckFuture::ready(answer()).observe(&first);
        assert!(ready.is_ready());
        assert_eq!(first.0.load(Ordering::Relaxed), 1);
        ready.await.unwrap();
        assert_eq!(
            first.0.load(Ordering::Relaxed),
            1,
            "shown once, not again when awaited"
        );

        let waiting = CheckFuture::waiting(async {
            tokio::task::yield_now().await;
            answer()
        })
        .observe(&first)
        .observe(&second);
        assert_eq!(first.0.load(Ordering::Relaxed), 1);
        assert_eq!(second.0.load(Ordering::Relaxed), 0);
        let order = std::sync::Mutex::new(Vec::new());
        let checked = waiting
            .map(|result| {
                order.lock().unwrap().extend([
                    first.0.load(Ordering::Relaxed),
                    second.0.load(Ordering::Relaxed),
                ]);
                result
            })
            .await;
        assert!(checked.is_ok());
        assert_eq!(
            *order.lock().unwrap(),
            [2, 1],
            "both shown before the step above"
        );
        assert_eq!(second.2.load(Ordering::Relaxed), 2, "the first shown first");

        // A check dropped before its answer came shows nothing.
        let dropped = CheckFuture::waiting(std::future::pending()).observe(&first);
        drop(dropped);
        assert_eq!(first.0.load(Ordering::Relaxed), 2);
    }
}
