//! Sliding-window counter: the fixed window's counter plus the previous
//! window's, weighted by how much of the previous window the sliding window
//! `(t - W, t]` still covers: `estimate = prev × (W - e) / W + cur`, with `e`
//! the time elapsed in the current window. Admit while `estimate + cost`
//! stays at most the limit. (Cloudflare's approach.)
//!
//! Two counters per key, O(1), and close to the exact log: it assumes the
//! previous window's requests were spread evenly. When they were bunched at
//! the window's end it under-counts them and can admit more than the limit
//! in a true sliding window (never more than the limit per fixed window);
//! when bunched at the start, it over-counts and refuses what the log would
//! admit. `loadtest compare` measures both.
//!
//! The comparison is done multiplied through by `W`, in integers, so it is
//! exact: `prev × (W - e) + (cur + cost) × W <= limit × W`. Limits keep
//! `limit × W` at most 2^53 ([`exact_in_lua`], checked at start-up) so the
//! Lua script computes the same integers.

use super::decision::{Decision, Packed};
use super::limit::{CostExceedsBurst, MAX_EXACT, Window};
use crate::clock::Micros;
use std::time::Duration;

/// Whether `window`'s exact comparison stays within what doubles (and so
/// the Lua script) compute exactly: `limit × W` at most 2^53.
pub fn exact_in_lua(window: &Window) -> bool {
    u128::from(window.limit) * u128::from(window.window_us) <= u128::from(MAX_EXACT) * 2
}

/// The current window's index and count, and the previous window's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterState {
    /// Index of the current window (`start / W`).
    pub index: u64,
    /// Tokens admitted in the current window.
    pub cur: u64,
    /// Tokens admitted in the window before it.
    pub prev: u64,
    /// The window length the index counts in (another length reads as no
    /// state: see [`super::fixed_window::FixedState::window_us`]).
    pub window_us: u64,
}

impl CounterState {
    /// The state in 16 bytes, if both counts fit 32 bits: the counts side
    /// by side, and the end of the next window (when both have expired).
    pub fn pack(&self) -> Option<Packed> {
        let fits = |n: u64| n <= u64::from(u32::MAX);
        (fits(self.cur) && fits(self.prev)).then(|| Packed {
            word: (self.cur << 32) | self.prev,
            full_at: (self.index + 2) * self.window_us,
        })
    }

    /// The state [`CounterState::pack`] packed under window length `w`.
    pub fn unpack(packed: Packed, w: u64) -> Self {
        Self {
            index: (packed.full_at / w).saturating_sub(2),
            cur: packed.word >> 32,
            prev: packed.word & u64::from(u32::MAX),
            window_us: w,
        }
    }
}

/// Decide one request of `cost` at `now`; returns the decision and the
/// state to store.
pub fn check(
    window: &Window,
    state: Option<CounterState>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<CounterState>), CostExceedsBurst> {
    window.check_cost(cost)?;
    let (w, limit) = (window.window_us, window.limit);
    // A state made under another window length reads as none.
    let state = state.filter(|s| s.window_us == w);
    // A clock behind the stored window is read as that window's start.
    let at = match state {
        Some(s) => now.max(s.index * w),
        None => now,
    };
    let index = at / w;
    let (mut cur, prev) = match state {
        Some(s) if s.index == index => (s.cur, s.prev),
        Some(s) if s.index + 1 == index => (0, s.cur),
        _ => (0, 0),
    };
    let e = at - index * w;
    let weighted = |prev: u64, e: u64| u128::from(prev) * u128::from(w - e);
    let fits = |prev: u64, e: u64, cur: u64| {
        weighted(prev, e) + u128::from(cur + cost) * u128::from(w)
            <= u128::from(limit) * u128::from(w)
    };
    let allowed = fits(prev, e, cur);
    if allowed {
        cur += cost;
    }
    // Whole tokens left: floor(limit - estimate).
    let used = weighted(prev, e) + u128::from(cur) * u128::from(w);
    let remaining =
        ((u128::from(limit) * u128::from(w)).saturating_sub(used) / u128::from(w)) as u64;
    let start = index * w;
    let retry_at = if fits(prev, e, cur) {
        at
    } else if let Some(e2) = first_fit(w, prev, limit.checked_sub(cur + cost)) {
        // Later in this window, as the previous window's weight decays.
        start + e2
    } else {
        // In the next window, where this window's count is the weighted one.
        let e2 = first_fit(w, cur, Some(limit - cost)).unwrap_or(w);
        start + w + e2
    };
    let reset_at = if cur > 0 {
        start + 2 * w
    } else if prev > 0 && e < w {
        start + w
    } else {
        now
    };
    let decision = Decision {
        allowed,
        limit,
        remaining,
        retry_after: Duration::from_micros(retry_at - now),
        reset: Duration::from_micros(reset_at.saturating_sub(now)),
    };
    // Only an admission that spends writes (as the script does); a stale
    // stored window reads the same as its advanced form.
    let stored = if allowed && cost > 0 {
        Some(CounterState {
            index,
            cur,
            prev,
            window_us: w,
        })
    } else {
        state
    };
    Ok((decision, stored))
}

/// The first elapsed time `e` in a window at which `prev × (W - e) <= room × W`,
/// if it comes before the window ends (`None` when `room` is negative or `e`
/// would be `W` or later).
fn first_fit(w: u64, prev: u64, room: Option<u64>) -> Option<u64> {
    let room = room?;
    if prev == 0 {
        return Some(0);
    }
    // W - e <= floor(room × W / prev)
    let most = u128::from(room) * u128::from(w) / u128::from(prev);
    let e = u128::from(w).saturating_sub(most) as u64;
    (e < w).then_some(e)
}
