//! Sliding-window log: remember when every admitted token was spent, and
//! admit while the tokens spent in the last `W` (the interval `(t - W, t]`)
//! plus this request stay at most the limit.
//!
//! Exact: it never admits more than the limit in any interval of length `W`
//! and never refuses what that rule allows (property tests hold it to both).
//! Its cost is memory: one entry per admitted token in the last window, so
//! memory grows with the admitted rate, up to the limit per key. In Redis
//! the log is a sorted set, and trimming it is the one step that is not
//! O(1) (amortised, each entry is trimmed once).
//!
//! Time per key only moves forward: a `now` older than the newest entry is
//! treated as that entry's instant.

use super::decision::Decision;
use super::limit::{CostExceedsBurst, Window};
use crate::clock::Micros;
use std::collections::VecDeque;
use std::time::Duration;

/// The largest burst a `sliding_log` limit may have: its log holds one
/// sorted-set member per token admitted in the window, per client.
pub const MAX_BURST: u64 = 100_000;

/// The admitted tokens' timestamps, oldest first (one entry per token).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogState {
    /// Timestamps in microseconds, ascending.
    pub entries: VecDeque<Micros>,
}

/// Decide one request of `cost` at `now`. Expired entries are trimmed
/// whatever the decision (the state is the same either way).
pub fn check(
    window: &Window,
    mut state: LogState,
    cost: u64,
    now: Micros,
) -> Result<(Decision, LogState), CostExceedsBurst> {
    window.check_cost(cost)?;
    let w = window.window_us;
    let at = state.entries.back().map_or(now, |&newest| now.max(newest));
    // An entry at `t` counts in `(at - W, at]`: gone once `t + W <= at`.
    while state.entries.front().is_some_and(|&t| t + w <= at) {
        state.entries.pop_front();
    }
    let count = state.entries.len() as u64;
    let allowed = count + cost <= window.limit;
    if allowed {
        state.entries.extend(std::iter::repeat_n(at, cost as usize));
    }
    let count = state.entries.len() as u64;
    // Another request of `cost` needs the oldest `count + cost - limit`
    // entries gone: it waits for the last of them to leave the window.
    let excess = (count + cost).saturating_sub(window.limit);
    let retry = match excess {
        0 => 0,
        n => state.entries[(n - 1) as usize] + w - now,
    };
    let reset = state.entries.back().map_or(0, |&newest| newest + w - now);
    let decision = Decision {
        allowed,
        limit: window.limit,
        // More entries than the limit (the policy was lowered) leave nothing.
        remaining: window.limit.saturating_sub(count),
        retry_after: Duration::from_micros(retry),
        reset: Duration::from_micros(reset),
    };
    Ok((decision, state))
}
