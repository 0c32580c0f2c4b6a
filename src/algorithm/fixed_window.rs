//! Fixed-window counter: count requests per window `[k·W, (k+1)·W)`, windows
//! aligned to the epoch, and admit while the count stays at most the limit.
//!
//! The cheapest algorithm: one counter per key, and a key that expires at
//! the window's end. Its failure: nothing connects two windows, so a client
//! that spends the limit at the end of one window and again at the start of
//! the next passes **2x the limit within a fraction of a window**. That is
//! also the most it can pass in any interval of length `W` (which touches at
//! most two windows); a property test holds it to exactly that.
//!
//! The window index is stored beside the count, so a clock that steps back
//! into an earlier window keeps counting in the stored one instead of
//! reopening the earlier window with a fresh count.

use super::decision::{Decision, Packed};
use super::limit::{CostExceedsBurst, Window};
use crate::clock::Micros;
use std::time::Duration;

/// The current window's index (`start / W`) and what it has admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedState {
    /// Index of the window the count belongs to.
    pub index: u64,
    /// Tokens admitted in it.
    pub count: u64,
    /// The window length the index counts in. A state made under another
    /// length (the policy changed) reads as none: its index would name a
    /// window decades away.
    pub window_us: u64,
}

impl FixedState {
    /// The state in 16 bytes: the count, and the window's end (when the
    /// count no longer matters).
    pub fn pack(&self) -> Packed {
        Packed {
            word: self.count,
            full_at: (self.index + 1) * self.window_us,
        }
    }

    /// The state [`FixedState::pack`] packed under window length `w` (a
    /// store lives as long as its config: one window length per limit).
    pub fn unpack(packed: Packed, w: u64) -> Self {
        Self {
            index: (packed.full_at / w).saturating_sub(1),
            count: packed.word,
            window_us: w,
        }
    }
}

/// Decide one request of `cost` at `now`; returns the decision and the
/// state to store.
pub fn check(
    window: &Window,
    state: Option<FixedState>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<FixedState>), CostExceedsBurst> {
    window.check_cost(cost)?;
    let w = window.window_us;
    let current = now / w;
    let FixedState {
        index, mut count, ..
    } = match state {
        Some(s) if s.window_us == w && s.index >= current => s,
        _ => FixedState {
            index: current,
            count: 0,
            window_us: w,
        },
    };
    let allowed = count + cost <= window.limit;
    if allowed {
        count += cost;
    }
    // Everything is measured from the real `now`, even when the stored
    // window is ahead of it.
    let end = (index + 1) * w - now;
    let decision = Decision {
        allowed,
        limit: window.limit,
        // A count above the limit (the policy was lowered) leaves nothing.
        remaining: window.limit.saturating_sub(count),
        retry_after: Duration::from_micros(if count + cost <= window.limit { 0 } else { end }),
        reset: Duration::from_micros(if count == 0 { 0 } else { end }),
    };
    // Only an admission that spends writes (as the script does): otherwise
    // what was stored stays, and reads the same.
    let stored = if allowed && cost > 0 {
        Some(FixedState {
            index,
            count,
            window_us: w,
        })
    } else {
        state
    };
    Ok((decision, stored))
}
