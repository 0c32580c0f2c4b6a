//! How much of an instance's recent deciding its fallback did, pure: every
//! method takes `now`, nothing reads a clock.
//!
//! The breaker's state says what it is doing this instant, and a PING says
//! Redis answers this instant; neither says that over the last seconds the
//! breaker opened again and again and the local share made most of the
//! decisions (each instance then admitting only its share of a client's
//! limit).
//! This counts, over a sliding window, the checks the failure policy saw
//! and those its failure mode decided, and the times the breaker opened:
//! what `/readyz` and `ratelimit_fallback_share` report.
//!
//! Two fixed windows, the previous one weighted by how much of it still
//! lies within one window of `now` (the sliding-window counter): O(1)
//! memory, exact when traffic is even, and never more than one window
//! behind.

use crate::clock::Micros;
use std::time::Duration;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    checks: u64,
    fallback: u64,
    opens: u64,
}

/// The recent checks and fallbacks. Not synchronised: the owner keeps it
/// behind a mutex.
#[derive(Debug, Clone)]
pub struct Recent {
    window_us: u64,
    /// Where the current window began.
    start: Micros,
    current: Counts,
    previous: Counts,
}

/// What [`Recent`] says about the last window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecentShare {
    /// Checks the failure policy saw (weighted: not a whole number).
    pub checks: f64,
    /// The share of them its failure mode decided, 0 to 1 (0 without
    /// checks).
    pub fallback_share: f64,
    /// Times the breaker opened (rounded to a whole number).
    pub breaker_opens: u64,
}

impl Recent {
    /// Over windows of `window`, starting at `now`.
    pub fn new(window: Duration, now: Micros) -> Self {
        Self {
            window_us: u64::try_from(window.as_micros()).unwrap_or(u64::MAX).max(1),
            start: now,
            current: Counts::default(),
            previous: Counts::default(),
        }
    }

    /// Moves the windows on to `now`.
    fn roll(&mut self, now: Micros) {
        let elapsed = now.saturating_sub(self.start);
        if elapsed < self.window_us {
            return;
        }
        self.previous = if elapsed < 2 * self.window_us {
            self.current
        } else {
            Counts::default()
        };
        self.current = Counts::default();
        self.start = now - elapsed % self.window_us;
    }

    /// A check was decided: by Redis (`fallback` false) or by the failure
    /// mode.
    pub fn decided(&mut self, now: Micros, fallback: bool) {
        self.roll(now);
        self.current.checks += 1;
        self.current.fallback += u64::from(fallback);
    }

    /// The breaker opened.
    pub fn opened(&mut self, now: Micros) {
        self.roll(now);
        self.current.opens += 1;
    }

    /// The last window, as of `now`.
    pub fn share(&mut self, now: Micros) -> RecentShare {
        self.roll(now);
        let into = now.saturating_sub(self.start) as f64 / self.window_us as f64;
        let weight = (1.0 - into).clamp(0.0, 1.0);
        let weighted = |current: u64, previous: u64| current as f64 + previous as f64 * weight;
        let checks = weighted(self.current.checks, self.previous.checks);
        let fallback = weighted(self.current.fallback, self.previous.fallback);
        RecentShare {
            checks,
            fallback_share: if checks > 0.0 {
                (fallback / checks).clamp(0.0, 1.0)
            } else {
                0.0
            },
            breaker_opens: weighted(self.current.opens, self.previous.opens).round() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Micros = 1_000_000_000;
    const SEC: Micros = 1_000_000;

    fn recent() -> Recent {
        Recent::new(Duration::from_secs(10), T0)
    }

    #[test]
    fn the_share_is_of_the_checks_the_fallback_decided() {
        let mut r = recent();
        assert_eq!(r.share(T0).fallback_share, 0.0, "no checks, no share");
        for i in 0..20 {
            r.decided(T0 + i, i % 4 == 0);
        }
        r.opened(T0 + 5);
        let s = r.share(T0 + SEC);
        assert_eq!(s.checks, 20.0);
        assert!((s.fallback_share - 0.25).abs() < 1e-9, "{s:?}");
        assert_eq!(s.breaker_opens, 1);
    }

    #[test]
    fn old_checks_fade_out_with_the_window() {
        let mut r = recent();
        for i in 0..100 {
            r.decided(T0 + i, true);
        }
        r.opened(T0);
        // Half-way through the next window, half of the last one counts.
        let s = r.share(T0 + 15 * SEC);
        assert!((s.checks - 50.0).abs() < 1e-6, "{s:?}");
        assert_eq!(s.fallback_share, 1.0);
        // Healthy checks since then dilute it.
        for i in 0..50 {
            r.decided(T0 + 15 * SEC + i, false);
        }
        let s = r.share(T0 + 15 * SEC + 100);
        assert!((s.fallback_share - 0.5).abs() < 1e-3, "{s:?}");
        // Two windows on, nothing of the fallback is left.
        let s = r.share(T0 + 30 * SEC);
        assert_eq!(s.fallback_share, 0.0, "{s:?}");
        assert_eq!(s.breaker_opens, 0);
        // A long silence forgets everything.
        r.decided(T0 + 1000 * SEC, false);
        let s = r.share(T0 + 1000 * SEC);
        assert_eq!((s.checks, s.fallback_share), (1.0, 0.0));
    }

    #[test]
    fn a_clock_before_the_window_changes_nothing() {
        let mut r = recent();
        r.decided(T0 + SEC, true);
        r.decided(T0, false);
        let s = r.share(T0 + SEC);
        assert_eq!((s.checks, s.fallback_share), (2.0, 0.5));
    }
}
