//! The other algorithms, beside the token bucket, each exact and pure.
//!
//! Every algorithm reads the same [`Limit`] (`burst` tokens refilled at
//! `rate` per `period`) and answers with the same [`Decision`], so the HTTP
//! headers and `Retry-After` work for all of them:
//!
//! | algorithm | reads the limit as | state per key | "reset" means |
//! |---|---|---|---|
//! | `token_bucket` ([`crate::bucket`]) | `burst`, refilled `rate`/`period` | tokens, last | until the bucket is full |
//! | `gcra` | the same bucket as one instant | theoretical arrival time | until the bucket is full |
//! | `fixed_window` | `burst` requests per window `W` | window, count | until the window's count resets |
//! | `sliding_log` | `burst` requests in any `W` | one timestamp per token | until the log is empty |
//! | `sliding_window` | `burst` requests in any `W`, estimated | window, count, previous count | until the estimate is 0 |
//!
//! `W` is the time the bucket takes to refill from empty (`burst / rate ×
//! period`, rounded up to a microsecond): the window algorithms then allow
//! the same long-run rate and the same largest burst as the bucket. What
//! each one promises, and where it fails, is in its module and measured by
//! `cargo run -p loadtest -- compare`.
//!
//! Every algorithm runs in Redis (one Lua script each, `lua/`); all but the
//! log also run in the in-process store, in the same 16-byte entries.
//!
//! Like the bucket, every function takes `now` and the stored state and
//! returns the decision and the state to store; nothing reads a clock. A
//! `now` behind the stored state is treated as the stored instant (no time
//! passes), and waits are measured from the real `now`. GCRA is the one
//! exception, noted there.

pub mod fixed_window;
pub mod gcra;
pub mod sliding_log;
pub mod sliding_window;

use crate::bucket::{self, BucketState, CostExceedsBurst, Decision, Limit};
use crate::clock::Micros;
use serde::Deserialize;

/// Which algorithm a policy uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, clap::ValueEnum)]
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

/// A limit read as "`limit` requests per `window_us`".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Tokens (requests of cost 1) per window: the burst.
    pub limit: u64,
    /// The window in microseconds: the bucket's time to refill from empty.
    pub window_us: u64,
}

impl Window {
    /// The window reading of `limit`.
    pub fn of(limit: &Limit) -> Self {
        Self {
            limit: limit.burst(),
            window_us: limit
                .capacity_units()
                .div_ceil(limit.rate_units_per_us())
                .max(1),
        }
    }
}

/// Any algorithm's stored state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// [`crate::bucket`].
    Bucket(BucketState),
    /// [`gcra`].
    Gcra(gcra::GcraState),
    /// [`fixed_window`].
    Fixed(fixed_window::FixedState),
    /// [`sliding_log`].
    Log(sliding_log::LogState),
    /// [`sliding_window`].
    Counter(sliding_window::CounterState),
}

/// Decide one request with the limit's algorithm. `state` is what a store
/// holds for the key (`None`: no key); the result's state is what it should
/// hold afterwards (`None`: no key), exactly as the Lua scripts keep it. A
/// state of another algorithm's shape reads as no key.
pub fn check(
    limit: &Limit,
    state: Option<State>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<State>), CostExceedsBurst> {
    let window = Window::of(limit);
    Ok(match limit.algorithm() {
        Algorithm::TokenBucket => {
            let s = match state {
                Some(State::Bucket(s)) => Some(s),
                _ => None,
            };
            let (d, next) = bucket::check(limit, s, cost, now)?;
            // The stores keep no key for a full bucket, and a denial
            // writes nothing.
            let kept = if !d.allowed {
                s
            } else {
                (!d.reset.is_zero()).then_some(next)
            };
            (d, kept.map(State::Bucket))
        }
        Algorithm::Gcra => {
            let s = match state {
                Some(State::Gcra(s)) => Some(s),
                _ => None,
            };
            let (d, s) = gcra::check(limit, s, cost, now)?;
            (d, s.map(State::Gcra))
        }
        Algorithm::FixedWindow => {
            let s = match state {
                Some(State::Fixed(s)) => Some(s),
                _ => None,
            };
            let (d, s) = fixed_window::check(&window, s, cost, now)?;
            (d, s.map(State::Fixed))
        }
        Algorithm::SlidingLog => {
            let s = match state {
                Some(State::Log(s)) => s,
                _ => sliding_log::LogState::default(),
            };
            let (d, s) = sliding_log::check(&window, s, cost, now)?;
            (d, (!s.entries.is_empty()).then_some(State::Log(s)))
        }
        Algorithm::SlidingWindow => {
            let s = match state {
                Some(State::Counter(s)) => Some(s),
                _ => None,
            };
            let (d, s) = sliding_window::check(&window, s, cost, now)?;
            (d, s.map(State::Counter))
        }
    })
}

fn cost_fits(window: &Window, cost: u64) -> Result<(), CostExceedsBurst> {
    if cost > window.limit {
        Err(CostExceedsBurst {
            cost,
            burst: window.limit,
        })
    } else {
        Ok(())
    }
}

fn micros(us: u64) -> std::time::Duration {
    std::time::Duration::from_micros(us)
}

#[cfg(test)]
mod tests;
