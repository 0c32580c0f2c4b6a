//! A circuit breaker, pure: every method takes `now`, nothing reads a clock.
//!
//! Closed: every check calls Redis; `failures` consecutive failures open it.
//! Open: nobody calls Redis until `cooldown` has passed, so a dead Redis costs
//! requests nothing and a recovering one is not hit by every instance's
//! whole traffic at once. Half-open: exactly one request (the probe) calls
//! Redis; the rest keep using the fallback. The probe's success closes the
//! breaker, its failure opens it for another cooldown. A probe that never
//! reports (its task was dropped) is replaced after one cooldown, so the
//! breaker cannot wedge half-open.

use crate::clock::Micros;
use std::time::Duration;

/// Where the breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calling Redis; counting consecutive failures.
    Closed,
    /// Not calling Redis until the cooldown ends.
    Open,
    /// One probe is calling Redis.
    HalfOpen,
}

impl BreakerState {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The value of the state gauge: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        }
    }
}

/// What one check may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// Call Redis (breaker closed).
    Call,
    /// Call Redis as the half-open probe.
    Probe,
    /// Do not call Redis: use the failure mode.
    Skip,
}

/// A state change, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: BreakerState,
    /// After.
    pub to: BreakerState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inner {
    Closed { failures: u32 },
    Open { until: Micros },
    HalfOpen { since: Micros },
}

/// The breaker. Not synchronised: the owner keeps it behind a mutex.
#[derive(Debug, Clone)]
pub struct Breaker {
    inner: Inner,
    threshold: u32,
    cooldown_us: u64,
}

impl Breaker {
    /// Opens after `threshold` consecutive failures (at least 1), for `cooldown`.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            inner: Inner::Closed { failures: 0 },
            threshold: threshold.max(1),
            cooldown_us: u64::try_from(cooldown.as_micros()).unwrap_or(u64::MAX),
        }
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        match self.inner {
            Inner::Closed { .. } => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// How long until the next probe may go out (zero if Redis is called now).
    pub fn wait(&self, now: Micros) -> Duration {
        Duration::from_micros(match self.inner {
            Inner::Closed { .. } => 0,
            Inner::Open { until } => until.saturating_sub(now),
            Inner::HalfOpen { since } => since.saturating_add(self.cooldown_us).saturating_sub(now),
        })
    }

    fn go(&mut self, to: Inner) -> Option<Transition> {
        let from = self.state();
        self.inner = to;
        let to = self.state();
        (from != to).then_some(Transition { from, to })
    }

    /// May this check call Redis?
    pub fn permit(&mut self, now: Micros) -> (Permit, Option<Transition>) {
        match self.inner {
            Inner::Closed { .. } => (Permit::Call, None),
            Inner::Open { until } if now < until => (Permit::Skip, None),
            Inner::Open { .. } => (Permit::Probe, self.go(Inner::HalfOpen { since: now })),
            Inner::HalfOpen { since } if now >= since.saturating_add(self.cooldown_us) => {
                // The previous probe never reported: send another.
                self.inner = Inner::HalfOpen { since: now };
                (Permit::Probe, None)
            }
            Inner::HalfOpen { .. } => (Permit::Skip, None),
        }
    }

    /// Redis answered a check made under `permit`.
    pub fn success(&mut self, permit: Permit) -> Option<Transition> {
        match (self.inner, permit) {
            (Inner::Closed { failures }, _) if failures > 0 => {
                self.go(Inner::Closed { failures: 0 })
            }
            (Inner::HalfOpen { .. }, Permit::Probe) => self.go(Inner::Closed { failures: 0 }),
            // A call made while closed that answers after the breaker opened
            // proves little (it may have queued before the fault): the probe
            // decides.
            _ => None,
        }
    }

    /// Redis failed (or missed the deadline) on a check made under `permit`.
    pub fn failure(&mut self, permit: Permit, now: Micros) -> Option<Transition> {
        let open = Inner::Open {
            until: now.saturating_add(self.cooldown_us),
        };
        match (self.inner, permit) {
            (Inner::Closed { failures }, _) => {
                let failures = failures + 1;
                if failures >= self.threshold {
                    self.go(open)
                } else {
                    self.go(Inner::Closed { failures })
                }
            }
            (Inner::HalfOpen { .. }, Permit::Probe) => self.go(open),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use BreakerState::*;

    const T0: Micros = 1_000_000_000;
    const COOL: u64 = 500_000;

    fn breaker() -> Breaker {
        Breaker::new(3, Duration::from_micros(COOL))
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let mut b = breaker();
        assert_eq!(b.permit(T0).0, Permit::Call);
        b.failure(Permit::Call, T0);
        b.failure(Permit::Call, T0);
        b.success(Permit::Call);
        b.failure(Permit::Call, T0);
        b.failure(Permit::Call, T0);
        assert_eq!(b.state(), Closed, "a success resets the count");
        let t = b.failure(Permit::Call, T0 + 7);
        assert_eq!(
            t,
            Some(Transition {
                from: Closed,
                to: Open
            })
        );
        assert_eq!(b.wait(T0 + 7), Duration::from_micros(COOL));
    }

    #[test]
    fn open_skips_until_the_cooldown_then_sends_one_probe() {
        let mut b = breaker();
        for _ in 0..3 {
            b.failure(Permit::Call, T0);
        }
        assert_eq!(b.permit(T0 + COOL - 1), (Permit::Skip, None));
        let (p, t) = b.permit(T0 + COOL);
        assert_eq!(p, Permit::Probe);
        assert_eq!(
            t,
            Some(Transition {
                from: Open,
                to: HalfOpen
            })
        );
        // Everyone else keeps skipping while the probe is out.
        for dt in [0, 1, COOL - 1] {
            assert_eq!(b.permit(T0 + COOL + dt).0, Permit::Skip);
        }
        assert_eq!(
            b.success(Permit::Probe),
            Some(Transition {
                from: HalfOpen,
                to: Closed
            })
        );
        assert_eq!(b.permit(T0 + COOL + 1).0, Permit::Call);
    }

    #[test]
    fn a_failed_probe_opens_for_another_cooldown() {
        let mut b = breaker();
        for _ in 0..3 {
            b.failure(Permit::Call, T0);
        }
        let (p, _) = b.permit(T0 + COOL);
        // A late answer to a call made before the breaker opened decides nothing.
        assert_eq!(b.success(Permit::Call), None);
        assert_eq!(b.failure(Permit::Call, T0 + COOL), None);
        assert_eq!(b.state(), HalfOpen);
        assert_eq!(
            b.failure(p, T0 + COOL + 10),
            Some(Transition {
                from: HalfOpen,
                to: Open
            })
        );
        assert_eq!(b.permit(T0 + 2 * COOL + 9).0, Permit::Skip);
        assert_eq!(b.permit(T0 + 2 * COOL + 10).0, Permit::Probe);
    }

    #[test]
    fn a_lost_probe_is_replaced_after_a_cooldown() {
        let mut b = breaker();
        for _ in 0..3 {
            b.failure(Permit::Call, T0);
        }
        assert_eq!(b.permit(T0 + COOL).0, Permit::Probe);
        // The probe's task was dropped: it never reports.
        assert_eq!(b.permit(T0 + 2 * COOL - 1).0, Permit::Skip);
        assert_eq!(b.permit(T0 + 2 * COOL).0, Permit::Probe);
        assert_eq!(b.state(), HalfOpen);
    }
}
