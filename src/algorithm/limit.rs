//! What a limit is, before any algorithm reads it: `burst` tokens refilled
//! at `rate` per `period`, the algorithm that enforces it, and the integer
//! units every algorithm and Lua script compute in.
//!
//! Shared vocabulary: this module imports nothing else of the crate, so
//! everything (algorithms, stores, config, headers) can depend on it.
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
//! The Lua scripts in `lua/` use the same representation: capacity and rate
//! stay at or below 2^52 (checked in [`Limit::new`]), so every integer a
//! script forms, products included, is at most 2^53 and Redis's Lua, whose
//! numbers are doubles, computes the very same integers.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Largest capacity (in units) and rate (units per microsecond) accepted.
/// Doubles are exact up to 2^53; at or below 2^52, the products a Lua
/// implementation needs to correct its divisions (`q × rate` just above a
/// deficit) stay exact too, so it reproduces this arithmetic bit for bit.
pub const MAX_EXACT: u64 = 1 << 52;

/// Which algorithm enforces a limit. What each one needs (its script, its
/// key space, which stores can hold it) is described in one place:
/// `impl Algorithm` in [`crate::algorithm`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Token bucket: bursts up to `burst`, then `rate` (the default).
    #[default]
    TokenBucket,
    /// Generic cell rate algorithm: the token bucket as one timestamp.
    Gcra,
    /// Fixed-window counter: cheapest; up to 2x the limit across a boundary.
    FixedWindow,
    /// Sliding-window log: exact; memory grows with the request rate.
    SlidingLog,
    /// Sliding-window counter: two counters, the previous one weighted.
    SlidingWindow,
}

impl Algorithm {
    /// Every algorithm, in table order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
    ];

    /// The name used in config, metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
        }
    }
}

/// A validated limit: `burst` tokens, refilled `rate` per `period_us`, and
/// the algorithm that enforces it.
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

/// The request costs more than the limit can ever hold, so no amount of
/// waiting admits it. A configuration error, reported rather than answered
/// with a misleading `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cost {cost} exceeds the burst {burst}: the request can never be admitted")]
pub struct CostExceedsBurst {
    /// The cost asked for.
    pub cost: u64,
    /// The limit's capacity in tokens.
    pub burst: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Limit {
    /// `burst` tokens, refilled at `rate` tokens per `period`, enforced by
    /// the token bucket (see [`Limit::with_algorithm`]).
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

    /// The same limit, enforced by `algorithm`.
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

    /// The window reading of this limit (see [`Window`]).
    pub fn window(&self) -> Window {
        Window {
            limit: self.burst,
            window_us: self.capacity_units().div_ceil(self.rate).max(1),
        }
    }
}

/// A limit read as "`limit` requests per `window_us`", the way the window
/// algorithms read it.
///
/// `W` is the time the bucket takes to refill from empty (`burst / rate ×
/// period`, rounded up to a microsecond): the window algorithms then allow
/// the same long-run rate and the same largest burst as the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Tokens (requests of cost 1) per window: the burst.
    pub limit: u64,
    /// The window in microseconds: the bucket's time to refill from empty.
    pub window_us: u64,
}

impl Window {
    /// Refuses a cost no window could admit.
    pub fn check_cost(&self, cost: u64) -> Result<(), CostExceedsBurst> {
        if cost > self.limit {
            Err(CostExceedsBurst {
                cost,
                burst: self.limit,
            })
        } else {
            Ok(())
        }
    }
}
