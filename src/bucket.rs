//! The token bucket, exact and pure.
//!
//! A bucket holds up to `burst` tokens and gains `rate` tokens every `period`.
//! A request costs `cost` tokens and is admitted only if that many are there.
//! Refill is lazy: on each check we add `elapsed × rate` and clamp to `burst`.
//! There is no timer, so an idle client accumulates a full burst and may spend
//! it in one instant (burst 100 at 10/s: 100 requests at once, then 10/s).
//!
//! # Why integers
//! Floats drift: `0.1 + 0.1 + 0.1 != 0.3`, and a bucket checked a million
//! times at odd intervals ends up a token or two off. Here one token is
//! `period_us` *units*, and one microsecond refills `rate` units, so
//! `elapsed_us × rate` is an exact integer refill for any rate that is a whole
//! number of tokens per period (10/s, 100/min, 1 per 3 s). Nothing is ever
//! rounded in the state; rounding happens only when a decision is reported
//! (remaining tokens floor, waiting times ceil), which is what clients need.
//!
//! The same representation is used by the Lua script in `lua/`: capacity and
//! rate stay at or below 2^52 (checked in [`Limit::new`]), so every integer
//! the script forms, products included, is at most 2^53 and Redis's Lua,
//! whose numbers are doubles, computes the very same integers.
//!
//! The function never reads a clock or touches storage: it takes the stored
//! state and `now`, and returns the decision and the state to store.

use crate::algorithm::Algorithm;
use crate::clock::Micros;
use std::time::Duration;

/// Largest capacity (in units) and rate (units per microsecond) accepted.
/// Doubles are exact up to 2^53; at or below 2^52, the products a Lua
/// implementation needs to correct its divisions (`q × rate` just above a
/// deficit) stay exact too, so it reproduces this arithmetic bit for bit.
pub const MAX_EXACT: u64 = 1 << 52;

/// A validated bucket shape: `burst` tokens, refilled `rate` per `period_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    burst: u64,
    rate: u64,
    period_us: u64,
    algorithm: Algorithm,
}

/// Why a [`Limit`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// `burst` was 0: such a bucket could never admit anything.
    #[error("burst must be at least 1")]
    ZeroBurst,
    /// `rate` was 0: such a bucket would never refill.
    #[error("rate must be at least 1")]
    ZeroRate,
    /// The period was shorter than a microsecond.
    #[error("period must be at least 1 microsecond")]
    ZeroPeriod,
    /// `burst × period` (or the rate) exceeds 2^52, beyond which doubles (and
    /// so Lua) cannot reproduce the arithmetic exactly.
    #[error(
        "burst x period (in microseconds) must not exceed 2^52; use a shorter period or a smaller burst"
    )]
    TooLarge,
}

/// The request costs more than the bucket can ever hold, so no amount of
/// waiting admits it. A configuration error, reported rather than answered
/// with a misleading `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cost {cost} exceeds the burst {burst}: the request can never be admitted")]
pub struct CostExceedsBurst {
    /// The cost asked for.
    pub cost: u64,
    /// The bucket's capacity in tokens.
    pub burst: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Limit {
    /// `burst` tokens, refilled at `rate` tokens per `period`.
    ///
    /// The ratio `rate / period` is reduced first, so `100 per minute` and
    /// `5 per 3 s` are the same bucket and take the smallest integers.
    pub fn new(burst: u64, rate: u64, period: Duration) -> Result<Self, LimitError> {
        if burst == 0 {
            return Err(LimitError::ZeroBurst);
        }
        if rate == 0 {
            return Err(LimitError::ZeroRate);
        }
        let period_us = u64::try_from(period.as_micros()).map_err(|_| LimitError::TooLarge)?;
        if period_us == 0 {
            return Err(LimitError::ZeroPeriod);
        }
        let g = gcd(rate, period_us);
        let (rate, period_us) = (rate / g, period_us / g);
        match burst.checked_mul(period_us) {
            Some(cap) if cap <= MAX_EXACT && rate <= MAX_EXACT => Ok(Self {
                burst,
                rate,
                period_us,
                algorithm: Algorithm::TokenBucket,
            }),
            _ => Err(LimitError::TooLarge),
        }
    }

    /// `burst` tokens refilled at `per_second` tokens per second.
    pub fn per_second(burst: u64, per_second: u64) -> Result<Self, LimitError> {
        Self::new(burst, per_second, Duration::from_secs(1))
    }

    /// The same limit, enforced by `algorithm` (see [`crate::algorithm`]).
    pub fn with_algorithm(self, algorithm: Algorithm) -> Self {
        Self { algorithm, ..self }
    }

    /// The algorithm that enforces this limit (token bucket unless set).
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Refuses a cost no amount of waiting could admit.
    pub fn check_cost(&self, cost: u64) -> Result<(), CostExceedsBurst> {
        if cost > self.burst {
            Err(CostExceedsBurst {
                cost,
                burst: self.burst,
            })
        } else {
            Ok(())
        }
    }

    /// Capacity in whole tokens.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Units refilled per microsecond (after reducing the ratio).
    pub fn rate_units_per_us(&self) -> u64 {
        self.rate
    }

    /// Units per token (after reducing the ratio).
    pub fn units_per_token(&self) -> u64 {
        self.period_us
    }

    /// Capacity in units.
    pub fn capacity_units(&self) -> u64 {
        self.burst * self.period_us
    }

    /// Time for an empty bucket to become full again.
    pub fn refill_time(&self) -> Duration {
        Duration::from_micros(self.capacity_units().div_ceil(self.rate))
    }
}

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

/// The answer for one request, with everything the HTTP headers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request was admitted (and its cost deducted).
    pub allowed: bool,
    /// The bucket's capacity in whole tokens (`RateLimit-Limit`).
    pub limit: u64,
    /// Whole tokens left after this decision, rounded down.
    pub remaining: u64,
    /// How long until another request of the same cost would be admitted:
    /// zero if one would be right now. Exact to the microsecond: a request at
    /// `now + retry_after` is admitted, one a microsecond earlier is not.
    pub retry_after: Duration,
    /// How long until the bucket is full again (zero if it is full).
    pub reset: Duration,
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
    // Everything fits u64: capacity is at most 2^52 (checked in `Limit::new`),
    // and a refill that would overflow is larger than any deficit anyway.
    // (u64 rather than u128 also keeps the divisions single instructions.)
    let cap = limit.capacity_units();
    let unit = limit.period_us;
    let rate = limit.rate;
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
    let cost_units = cost * unit;
    let allowed = tokens >= cost_units;
    if allowed {
        tokens -= cost_units;
    }
    // Waiting times are computed at `at` and then measured from `now`.
    let skew = at - now;
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
    let decision = Decision {
        allowed,
        limit: limit.burst,
        // Denials (the hot path under attack) mostly hold less than a token:
        // skip the division then.
        remaining: if tokens < unit { 0 } else { tokens / unit },
        retry_after: wait(cost_units.saturating_sub(tokens)),
        reset: wait(cap - tokens),
    };
    let state = if allowed {
        BucketState { tokens, last: at }
    } else {
        given
    };
    Ok((decision, state))
}

#[cfg(test)]
mod tests;
