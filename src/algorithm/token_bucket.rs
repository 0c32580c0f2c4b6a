//! The token bucket, exact and pure.
//!
//! A bucket holds up to `burst` tokens and gains `rate` tokens every `period`.
//! A request costs `cost` tokens and is admitted only if that many are there.
//! Refill is lazy: on each check we add `elapsed × rate` and clamp to `burst`.
//! There is no timer, so an idle client accumulates a full burst and may spend
//! it in one instant (burst 100 at 10/s: 100 requests at once, then 10/s).
//!
//! Tokens are integer units (see [`super::limit`]), so refill is exact and
//! nothing drifts. `lua/token_bucket.lua` computes the same integers.
//!
//! The function never reads a clock or touches storage: it takes the stored
//! state and `now`, and returns the decision and the state to store.

use super::decision::{Decision, Packed};
use super::limit::{CostExceedsBurst, Limit};
use crate::clock::Micros;
use std::time::Duration;

/// What is stored per key: tokens (in units) as of `last` (microseconds).
///
/// No entry at all means a full bucket, which is why idle entries can be
/// evicted and expired without changing any decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// Tokens in units (`Limit::units_per_token` per token).
    pub tokens: u64,
    /// The instant `tokens` was computed for.
    pub last: Micros,
}

impl BucketState {
    /// The state in 16 bytes: its tokens, and the instant it is full again
    /// (`last + ceil(deficit / rate)`), which lets a store drop it once full
    /// without knowing its limit.
    #[inline]
    pub fn pack(&self, limit: &Limit) -> Packed {
        Packed {
            word: self.tokens,
            full_at: self.last.saturating_add(to_full(limit, self.tokens)),
        }
    }

    /// The tokens (in units) this bucket holds at `now`, refilled and
    /// clamped to the capacity (a `now` behind `last` refills nothing).
    pub fn level_at(&self, limit: &Limit, now: Micros) -> u64 {
        let cap = limit.capacity_units();
        let refill = now
            .saturating_sub(self.last)
            .saturating_mul(limit.rate_units_per_us());
        self.tokens.min(cap).saturating_add(refill).min(cap)
    }

    /// The state [`BucketState::pack`] packed, exactly: `last` is recovered
    /// from the limit every check passes in.
    #[inline]
    pub fn unpack(packed: Packed, limit: &Limit) -> Self {
        Self {
            tokens: packed.word,
            last: packed.full_at.saturating_sub(to_full(limit, packed.word)),
        }
    }
}

/// Microseconds a bucket holding `tokens` units takes to be full again.
#[inline]
fn to_full(limit: &Limit, tokens: u64) -> u64 {
    let deficit = limit.capacity_units().saturating_sub(tokens);
    let rate = limit.rate_units_per_us();
    // Rates reduce to 1 unit/us more often than not: skip the division.
    if rate == 1 {
        deficit
    } else {
        deficit.div_ceil(rate)
    }
}

/// Decide one request of `cost` tokens at `now`.
///
/// `state` is what was stored for the key, `None` if nothing was (a full
/// bucket). Returns the decision and the state to store. A `now` earlier than
/// `state.last` is treated as `state.last`: no refill, and the waiting times
/// reported are measured from the real `now`, so they stay exact.
///
/// A denial leaves no trace: the state returned is the one given, since
/// refilling it later from its own `last` reaches the same tokens (the clamp
/// is idempotent). Stores therefore write nothing on a denial, which is the
/// cheap path under attack, and Redis scripts need no write then either.
pub fn check(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, BucketState), CostExceedsBurst> {
    check_within(limit, state, cost, now, u64::MAX)
}

/// [`check`], with the bucket holding at most `ceiling` units after refill.
///
/// This is how a bucket is handed back from a local fallback to the shared
/// store without a fresh burst: while Redis was away, the client spent from
/// a local bucket; Redis's bucket either refilled meanwhile or, after a
/// restart, is absent (full). The caller passes the local bucket's level
/// (scaled to the fleet) as the ceiling until the local bucket is full again,
/// and the shared bucket cannot grant more than what the fallback left.
/// Like any other bound, a ceiling a denial does not store: the caller keeps
/// passing it while it applies, and it never raises a bucket.
pub fn check_within(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
    ceiling: u64,
) -> Result<(Decision, BucketState), CostExceedsBurst> {
    limit.check_cost(cost)?;
    Ok(decide_within(limit, state, cost, now, ceiling))
}

/// What a spend leaves to report, before it is a [`Decision`]: whether the
/// request was admitted, the bucket's level (units) after it, and how far
/// `now` lags the state's own instant (a clock stepped back).
///
/// Two words and a flag, so it leaves a store's lock in registers and the
/// decision (two `Duration`s and more) is built once, after the lock, where
/// the caller wants it. Built under the lock instead, the decision would be
/// written piecewise to the stack and copied out with wider loads, which
/// the CPU cannot forward from narrower stores: a stall on the in-memory
/// check's hot path (docs/bench-memory.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spent {
    /// Whether the request was admitted (and its cost deducted).
    pub allowed: bool,
    /// Units in the bucket after this request.
    pub tokens: u64,
    /// `max(now, last) - now`: waits are computed at the state's instant
    /// and measured from the real `now`.
    pub skew: u64,
}

impl Spent {
    /// The decision for a request of `cost` tokens under `limit`: remaining
    /// whole tokens (rounded down) and waits (rounded up to a microsecond).
    #[inline(always)]
    pub fn decision(self, limit: &Limit, cost: u64) -> Decision {
        let Spent {
            allowed,
            tokens,
            skew,
        } = self;
        let unit = limit.units_per_token();
        let rate = limit.rate_units_per_us();
        let wait = |deficit: u64| -> Duration {
            if deficit == 0 {
                Duration::ZERO
            } else {
                // Rates reduce to 1 unit/us more often than not (10/s, 100/min
                // are 1 token per 100_000 / 600_000 units); skip the division.
                let us = if rate == 1 {
                    deficit
                } else {
                    deficit.div_ceil(rate)
                };
                Duration::from_micros(us.saturating_add(skew))
            }
        };
        Decision {
            allowed,
            limit: limit.burst(),
            // Denials (the hot path under attack) mostly hold less than a
            // token: skip the division then.
            remaining: if tokens < unit { 0 } else { tokens / unit },
            retry_after: wait(cost.saturating_mul(unit).saturating_sub(tokens)),
            reset: wait(limit.capacity_units() - tokens),
        }
    }
}

/// [`check_within`] for a cost already checked against the burst (a larger
/// one is denied, never admitted, with meaningless waits): the form that
/// runs under a store's lock, with no error to carry.
#[inline]
pub fn decide_within(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
    ceiling: u64,
) -> (Decision, BucketState) {
    let (spent, state) = spend(limit, state, cost, now, ceiling);
    (spent.decision(limit, cost), state)
}

/// The state change of [`decide_within`], without building the decision
/// ([`Spent::decision`] does that).
#[inline(always)]
pub fn spend(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
    ceiling: u64,
) -> (Spent, BucketState) {
    // Everything fits u64: capacity is at most 2^52 (checked in `Limit::new`),
    // and a refill that would overflow is larger than any deficit anyway.
    // (u64 rather than u128 also keeps the divisions single instructions.)
    let cap = limit.capacity_units();
    let rate = limit.rate_units_per_us();
    let given = state.unwrap_or(BucketState {
        tokens: cap,
        last: now,
    });
    let BucketState { tokens, last } = given;
    // A state from a corrupted or differently shaped bucket must not grant
    // more than a full bucket.
    let mut tokens = tokens.min(cap);
    let at = now.max(last);
    tokens += (at - last).saturating_mul(rate).min(cap - tokens);
    tokens = tokens.min(ceiling);
    let cost_units = cost.saturating_mul(limit.units_per_token());
    let allowed = tokens >= cost_units;
    if allowed {
        tokens -= cost_units;
    }
    let spent = Spent {
        allowed,
        tokens,
        skew: at - now,
    };
    let state = if allowed {
        BucketState { tokens, last: at }
    } else {
        given
    };
    (spent, state)
}

/// A take beyond an admitted request's cost, for a lease: as many whole
/// tokens as the bucket still holds, at most `extra`, granted only if the
/// bucket is then left with at most `leave` whole tokens (otherwise none).
///
/// Why the condition: a lease may be held only while the shared bucket
/// stays below its burst (see `src/mitigation/leases.rs`), so tokens taken
/// from a nearly full bucket could not be held and would be lost. Decided
/// in the same atomic step as the request, a lease costs no call of its own
/// and never fails for want of a full lease's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeUpTo {
    /// At most this many whole tokens beyond the request's cost.
    pub extra: u64,
    /// Granted only if at most this many whole tokens remain after it.
    pub leave: u64,
}

impl TakeUpTo {
    /// No take: the request's cost alone.
    pub const NONE: Self = Self { extra: 0, leave: 0 };
}

/// [`spend`] with a [`TakeUpTo`]: the request's cost first, then, if it was
/// admitted, the extra whole tokens the take grants (the third value).
/// Remaining tokens and waits are reported for the bucket after both, with
/// `retry_after` still for a request of `cost`.
#[inline(always)]
pub fn spend_up_to(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
    ceiling: u64,
    take: TakeUpTo,
) -> (Spent, BucketState, u64) {
    let (mut spent, mut next) = spend(limit, state, cost, now, ceiling);
    // No division unless a take asks (the plain check's hot path).
    if !spent.allowed || take.extra == 0 {
        return (spent, next, 0);
    }
    let unit = limit.units_per_token();
    let whole = spent.tokens / unit;
    let extra = take.extra.min(whole);
    if extra == 0 || whole - extra > take.leave {
        return (spent, next, 0);
    }
    spent.tokens -= extra * unit;
    next.tokens = spent.tokens;
    (spent, next, extra)
}

/// [`check_within`] with a [`TakeUpTo`]: the decision, the state to store,
/// and the extra tokens granted.
pub fn check_up_to(
    limit: &Limit,
    state: Option<BucketState>,
    cost: u64,
    now: Micros,
    ceiling: u64,
    take: TakeUpTo,
) -> Result<(Decision, BucketState, u64), CostExceedsBurst> {
    limit.check_cost(cost)?;
    let (spent, next, extra) = spend_up_to(limit, state, cost, now, ceiling, take);
    Ok((spent.decision(limit, cost), next, extra))
}

/// [`spend_packed`] with a [`TakeUpTo`]; the second value is the extra
/// tokens granted.
#[inline(always)]
pub fn spend_packed_up_to(
    limit: &Limit,
    state: &mut Option<Packed>,
    cost: u64,
    now: Micros,
    ceiling: u64,
    take: TakeUpTo,
) -> (Spent, u64) {
    let bucket = state.map(|p| BucketState::unpack(p, limit));
    let (spent, next, extra) = spend_up_to(limit, bucket, cost, now, ceiling, take);
    if spent.allowed {
        // Full again (`reset` zero) is no entry.
        *state = (spent.tokens < limit.capacity_units()).then(|| next.pack(limit));
    }
    (spent, extra)
}

/// [`decide_within`] on a packed state, as the in-process store keeps it:
/// `state` (`None`: no entry, a full bucket) is left holding what to keep.
/// A denial leaves it as it was; a bucket full again leaves no entry.
#[inline]
pub fn decide_packed(
    limit: &Limit,
    state: &mut Option<Packed>,
    cost: u64,
    now: Micros,
    ceiling: u64,
) -> Decision {
    spend_packed(limit, state, cost, now, ceiling).decision(limit, cost)
}

/// The state change of [`decide_packed`]: what runs under the in-process
/// store's lock.
#[inline(always)]
pub fn spend_packed(
    limit: &Limit,
    state: &mut Option<Packed>,
    cost: u64,
    now: Micros,
    ceiling: u64,
) -> Spent {
    spend_packed_up_to(limit, state, cost, now, ceiling, TakeUpTo::NONE).0
}

#[cfg(test)]
mod tests;
