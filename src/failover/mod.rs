//! What the limiter does when its shared store misbehaves: a wrapper around
//! a [`Store`] with a deadline, a circuit breaker and a failure mode.
//!
//! A limiter that stalls or vanishes with Redis is worse than none. Every
//! Redis check here has a deadline (default 10 ms, against a loopback round
//! trip of ~0.1 ms): a request never waits on Redis longer than that. A
//! check that fails or misses it is decided by the policy's failure mode, and
//! so is every check while the [`Breaker`] is open (after repeated failures
//! nobody calls Redis for a cooldown; then one probe does).
//!
//! | mode | while Redis is away | the risk it takes |
//! |---|---|---|
//! | `open` | admit, no rate headers | knocking Redis over removes the limit |
//! | `closed` | 503 + `Retry-After` (the client is not at fault) | a Redis blip is an outage |
//! | `local` (default) | each instance enforces its share of the limit in memory | the fleet's admission is bounded near the limit if traffic is spread evenly |
//!
//! # The local share
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
//! burst. So while a client's local bucket is not yet full again, each Redis
//! check carries a ceiling ([`crate::bucket::check_within`]): the shared
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

pub use breaker::{Breaker, BreakerState, Permit, Transition};

use crate::algorithm::Algorithm;
use crate::bucket::{Decision, Limit, LimitError};
use crate::clock::Micros;
use crate::metrics as m;
use crate::store::{BucketKey, MemoryStore, Store, StoreError};
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// What a policy does while its shared store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Admit (and say so in the metrics).
    Open,
    /// Refuse with 503 and `Retry-After`.
    Closed,
    /// Enforce this instance's share of the limit in memory.
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
}

impl Source {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Redis => "redis",
            Source::Memory => "memory",
            Source::Local => "local",
            Source::FailOpen => "failopen",
        }
    }
}

/// The failure policy's settings (validated config).
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

impl Default for FailoverSettings {
    fn default() -> Self {
        Self {
            mode: FailureMode::Local,
            deadline: Duration::from_millis(10),
            instances: 1,
            breaker_failures: 5,
            breaker_cooldown: Duration::from_millis(500),
        }
    }
}

/// A decision and who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// The decision (`None` when failing open: nothing was counted).
    pub decision: Option<Decision>,
    /// The limit the decision applied (the local share when `Local`).
    pub limit: Limit,
    /// Who decided.
    pub source: Source,
}

/// Why no decision could be made.
#[derive(Debug, thiserror::Error)]
pub enum FailoverError {
    /// The shared store is away and the mode is `closed`.
    #[error("the shared store is unavailable")]
    Unavailable {
        /// When a retry may succeed (the breaker's next probe, at least 1 s).
        retry_after: Duration,
    },
    /// The store refused the request itself (not a store failure).
    #[error(transparent)]
    Store(StoreError),
}

/// The local share of `limit` among `instances` (see the module docs).
pub fn share(limit: &Limit, instances: u64, cost: u64) -> Limit {
    // Config validation builds every policy's share at start-up, so this
    // cannot fail at run time; the whole limit is the fallback only for a
    // limit built without that validation.
    try_share(limit, instances, cost).unwrap_or(limit.with_algorithm(Algorithm::TokenBucket))
}

/// [`share`], or why its limit cannot be represented (`burst × period × N`
/// beyond what the integer arithmetic keeps exact).
pub fn try_share(limit: &Limit, instances: u64, cost: u64) -> Result<Limit, LimitError> {
    // Whatever the policy's algorithm, the local share is a token bucket:
    // the in-process store keeps that one, and its mirror and ceiling are
    // bucket levels.
    let limit = limit.with_algorithm(Algorithm::TokenBucket);
    if instances <= 1 {
        return Ok(limit);
    }
    // At least one token (or the cost) each: with a burst below N the fleet
    // can pass up to N of them between its local shares.
    let burst = (limit.burst() / instances).max(cost).max(1);
    // rate / (period × N), in the limit's own units: period_us is the
    // reduced period, rate_units_per_us the reduced rate.
    let period_us = limit
        .units_per_token()
        .checked_mul(instances)
        .ok_or(LimitError::TooLarge)?;
    Limit::new(
        burst,
        limit.rate_units_per_us(),
        Duration::from_micros(period_us),
    )
}

/// A store wrapped in a deadline, a breaker and failure modes.
#[derive(Debug)]
pub struct Failover {
    primary: Arc<dyn Store>,
    source: Source,
    /// `None` for an in-process primary: there is nothing to fail over from.
    guard: Option<Guard>,
}

#[derive(Debug)]
struct Guard {
    settings: FailoverSettings,
    breaker: Mutex<Breaker>,
    local: MemoryStore,
    /// Until when some local bucket may be below full: ceilings are looked
    /// up only before this instant, so the normal path costs one atomic load.
    local_until: AtomicU64,
    /// The breaker's clock: monotonic, so a wall clock stepping back cannot
    /// hold it open (bucket state uses the wall clock `now`, shared with
    /// other instances; the breaker is this process's alone).
    epoch: tokio::time::Instant,
}

impl Failover {
    /// Wraps `primary`. An in-memory primary is used as is; any other gets
    /// the deadline, the breaker and a local store of `local_keys` buckets.
    pub fn new(
        primary: Arc<dyn Store>,
        settings: FailoverSettings,
        local_keys: usize,
        local_shards: usize,
    ) -> Self {
        let in_process = primary.in_process();
        let guard = (!in_process).then(|| {
            metrics::gauge!(m::FALLBACK_ACTIVE).set(0.0);
            metrics::gauge!(m::BREAKER_STATE).set(BreakerState::Closed.gauge());
            Guard {
                breaker: Mutex::new(Breaker::new(
                    settings.breaker_failures,
                    settings.breaker_cooldown,
                )),
                settings,
                local: MemoryStore::new(local_keys, local_shards),
                local_until: AtomicU64::new(0),
                epoch: tokio::time::Instant::now(),
            }
        });
        Self {
            primary,
            source: if in_process {
                Source::Memory
            } else {
                Source::Redis
            },
            guard,
        }
    }

    /// The primary's backend name.
    pub fn backend(&self) -> &'static str {
        self.primary.backend()
    }

    /// Whether the primary can decide right now.
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.primary.ready().await
    }

    /// The breaker's state (`Closed` for an in-process primary).
    pub fn breaker_state(&self) -> BreakerState {
        self.guard.as_ref().map_or(BreakerState::Closed, |g| {
            g.breaker
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .state()
        })
    }

    /// Decide `cost` for `key` under `limit` at `now`; `mode` says what to
    /// do if the primary cannot.
    pub async fn check(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        mode: FailureMode,
    ) -> Result<Checked, FailoverError> {
        let Some(guard) = &self.guard else {
            let decision = self
                .primary
                .check(key, limit, cost, now)
                .await
                .map_err(FailoverError::Store)?;
            return Ok(Checked {
                decision: Some(decision),
                limit,
                source: self.source,
            });
        };
        let permit = guard.permit(guard.monotonic());
        if permit != Permit::Skip {
            let ceiling = guard.ceiling(key, &limit, cost, now);
            let call = self.primary.check_within(key, limit, cost, now, ceiling);
            let kind = match tokio::time::timeout(guard.settings.deadline, call).await {
                Ok(Ok(decision)) => {
                    guard.report(|b| b.success(permit));
                    guard.mirror(key, &limit, cost, &decision, now);
                    return Ok(Checked {
                        decision: Some(decision),
                        limit,
                        source: self.source,
                    });
                }
                // The request itself is at fault, not the store (which
                // answered, so a probe has its answer).
                Ok(Err(e)) if e.is_request_error() => {
                    guard.report(|b| b.success(permit));
                    return Err(FailoverError::Store(e));
                }
                Ok(Err(e)) => e.kind(),
                Err(_elapsed) => "deadline",
            };
            metrics::counter!(m::STORE_ERRORS_TOTAL, "backend" => self.primary.backend(), "kind" => kind)
                .increment(1);
            tracing::debug!(kind, ?permit, "redis check failed");
            let at = guard.monotonic();
            guard.report(|b| b.failure(permit, at));
        }
        guard.fall_back(key, limit, cost, now, mode)
    }
}

impl Guard {
    /// Microseconds on the breaker's monotonic clock.
    fn monotonic(&self) -> Micros {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn permit(&self, now: Micros) -> Permit {
        let (permit, transition) = self
            .breaker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .permit(now);
        if let Some(t) = transition {
            record(t);
        }
        permit
    }

    fn report(&self, f: impl FnOnce(&mut Breaker) -> Option<Transition>) {
        let transition = f(&mut self.breaker.lock().unwrap_or_else(PoisonError::into_inner));
        if let Some(t) = transition {
            record(t);
        }
    }

    /// Keeps the local share at the shared bucket's level (as time to full),
    /// so that losing Redis does not hand every client a fresh local burst.
    fn mirror(&self, key: BucketKey, limit: &Limit, cost: u64, decision: &Decision, now: Micros) {
        let share = share(limit, self.settings.instances, cost);
        match limit.algorithm() {
            // A bucket: the same time until full.
            Algorithm::TokenBucket | Algorithm::Gcra => {
                let reset = u64::try_from(decision.reset.as_micros()).unwrap_or(u64::MAX);
                self.local.set_reset(key, &share, reset, now);
            }
            // A window's "reset" is when its count clears, not a refill:
            // mirror the room left instead, as the same fraction of the share.
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingWindow => {
                let room = u128::from(decision.remaining.min(decision.limit))
                    * u128::from(share.capacity_units())
                    / u128::from(decision.limit.max(1));
                self.local.set_level(key, &share, room as u64, now);
            }
        }
    }

    /// The ceiling for a shared token bucket while the local one refills:
    /// the level that is full again when the local bucket is. Mirroring
    /// sets the local bucket by the same time to full, so for a client that
    /// never fell back the ceiling is the shared level itself (less one
    /// microsecond of refill, so it cannot bind by rounding), and for one
    /// that spent its local share it is what the fallback left.
    fn ceiling(&self, key: BucketKey, limit: &Limit, cost: u64, now: Micros) -> Option<u64> {
        if limit.algorithm() != Algorithm::TokenBucket
            || now >= self.local_until.load(Ordering::Relaxed)
        {
            return None;
        }
        let share = share(limit, self.settings.instances, cost);
        let level = self.local.level(key, &share, now)?;
        let to_full = (share.capacity_units() - level.min(share.capacity_units()))
            / share.rate_units_per_us();
        let deficit = u128::from(to_full.saturating_sub(1)) * u128::from(limit.rate_units_per_us());
        Some(u128::from(limit.capacity_units()).saturating_sub(deficit) as u64)
    }

    fn fall_back(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        mode: FailureMode,
    ) -> Result<Checked, FailoverError> {
        match mode {
            FailureMode::Open => Ok(Checked {
                decision: None,
                limit,
                source: Source::FailOpen,
            }),
            FailureMode::Closed => {
                let wait = self
                    .breaker
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .wait(self.monotonic());
                Err(FailoverError::Unavailable {
                    retry_after: wait.max(Duration::from_secs(1)),
                })
            }
            FailureMode::Local => {
                let share = share(&limit, self.settings.instances, cost);
                let decision = self
                    .local
                    .check_sync(key, &share, cost, now)
                    .map_err(|e| FailoverError::Store(e.into()))?;
                let full_at = now
                    .saturating_add(u64::try_from(decision.reset.as_micros()).unwrap_or(u64::MAX));
                self.local_until.fetch_max(full_at, Ordering::Relaxed);
                Ok(Checked {
                    decision: Some(decision),
                    limit: share,
                    source: Source::Local,
                })
            }
        }
    }
}

fn record(t: Transition) {
    metrics::counter!(m::BREAKER_TRANSITIONS_TOTAL, "from" => t.from.as_str(), "to" => t.to.as_str())
        .increment(1);
    metrics::gauge!(m::BREAKER_STATE).set(t.to.gauge());
    metrics::gauge!(m::FALLBACK_ACTIVE).set(if t.to == BreakerState::Closed {
        0.0
    } else {
        1.0
    });
    match t.to {
        BreakerState::Open if t.from == BreakerState::Closed => {
            tracing::warn!("redis circuit breaker open: deciding by the failure mode");
        }
        BreakerState::Open => tracing::debug!("redis probe failed: breaker open again"),
        BreakerState::HalfOpen => tracing::info!("redis circuit breaker half-open: probing"),
        BreakerState::Closed => tracing::info!("redis circuit breaker closed: redis decides again"),
    }
}

#[cfg(test)]
mod tests;
