//! GCRA, the generic cell rate algorithm: a token bucket stored as one
//! instant, the *theoretical arrival time* (TAT): when the bucket would be
//! full again. A request of `cost` moves the TAT `cost × T` later (`T` the
//! time one token takes to refill) and is admitted if the TAT then lies at
//! most `burst × T` ahead of now. redis-cell and governor work this way.
//!
//! The same integer fixed point as the bucket keeps it exact: one token is
//! `period_us` units and a microsecond refills `rate` units, so `T` is
//! `unit / rate` microseconds, generally not whole. The TAT is kept as whole
//! microseconds plus a remainder in units (`tat + rem / rate`, `rem < rate`);
//! for the common rates that reduce to 1 unit per µs (10/s, 100/min) the
//! remainder is always 0 and the state is literally one timestamp.
//!
//! On a clock that only moves forward its decisions are the token bucket's,
//! bit for bit (a property test runs both). It differs on a clock that steps
//! back: the bucket treats the step as no time passing, GCRA measures the
//! TAT from the earlier `now`, so it reads *less* refill (more conservative).

use super::decision::{Decision, Packed};
use super::limit::{CostExceedsBurst, Limit};
use crate::clock::Micros;
use std::time::Duration;

/// The theoretical arrival time: `tat + rem / rate` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcraState {
    /// Whole microseconds.
    pub tat: Micros,
    /// The fraction, in units (less than the limit's rate).
    pub rem: u64,
}

impl GcraState {
    /// The state in 16 bytes: the TAT is the instant the bucket is full
    /// again, the remainder rides in the word.
    pub fn pack(&self) -> Packed {
        Packed {
            word: self.rem,
            full_at: self.tat,
        }
    }

    /// The state [`GcraState::pack`] packed.
    pub fn unpack(packed: Packed) -> Self {
        Self {
            tat: packed.full_at,
            rem: packed.word,
        }
    }
}

/// How far `state`'s TAT lies ahead of `now`, in units (0 if behind).
fn ahead_units(state: GcraState, now: Micros, rate: u64) -> u64 {
    if state.tat >= now {
        (state.tat - now)
            .saturating_mul(rate)
            .saturating_add(state.rem)
    } else {
        0
    }
}

/// Decide one request of `cost` at `now`; returns the decision and the
/// state to store: the one given on a denial, `None` (no key) for a full
/// bucket, as the Lua script keeps it.
pub fn check(
    limit: &Limit,
    state: Option<GcraState>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<GcraState>), CostExceedsBurst> {
    limit.check_cost(cost)?;
    let cap = limit.capacity_units();
    let unit = limit.units_per_token();
    let rate = limit.rate_units_per_us();
    // A TAT in the past is a full bucket: the TAT restarts from now.
    let given = state.unwrap_or(GcraState { tat: now, rem: 0 });
    let base = if ahead_units(given, now, rate) == 0 {
        GcraState { tat: now, rem: 0 }
    } else {
        given
    };
    let rem = base.rem + cost * unit;
    let moved = GcraState {
        tat: base.tat + rem / rate,
        rem: rem % rate,
    };
    let allowed = ahead_units(moved, now, rate) <= cap;
    let kept = if allowed { moved } else { given };
    // (A denial keeps what was stored; `given` stands in for "nothing".)
    let ahead = ahead_units(kept, now, rate);
    // The bucket's level is what the TAT leaves of the capacity.
    let tokens = cap.saturating_sub(ahead);
    let wait = |units: u64| -> u64 {
        if rate == 1 {
            units
        } else {
            units.div_ceil(rate)
        }
    };
    let decision = Decision {
        allowed,
        limit: limit.burst(),
        remaining: tokens / unit,
        retry_after: Duration::from_micros(wait((ahead + cost * unit).saturating_sub(cap))),
        reset: Duration::from_micros(wait(ahead)),
    };
    let stored = match (allowed, ahead) {
        (false, _) => state,
        (true, 0) => None,
        (true, _) => Some(moved),
    };
    Ok((decision, stored))
}
