//! Time, passed in.
//!
//! The algorithms never read a clock: callers read one here and hand the
//! instant to them. Instants are **microseconds since the Unix epoch** (`u64`)
//! because later backends share bucket state between processes through Redis,
//! and only wall-clock time means the same thing in two processes. Wall clocks
//! can step backwards (NTP); the algorithms treat a `now` older than the state
//! they are given as "no time has passed", so a step back never refills and
//! never corrupts state.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch.
pub type Micros = u64;

/// Microseconds in one second.
pub const MICROS_PER_SEC: u64 = 1_000_000;

/// A source of "now". Cheap to call, shared between tasks.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current instant in microseconds since the Unix epoch.
    fn now(&self) -> Micros;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Micros {
        // A clock before 1970 is a broken host; saturate to 0 rather than
        // panic on the request path. The algorithms tolerate any value.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to. Clones share the same instant, so a
/// test can hold one handle and give another to the server under test.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `start` microseconds.
    pub fn new(start: Micros) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Jump to an absolute instant (backwards too: that is what we test).
    pub fn set(&self, now: Micros) {
        self.now.store(now, Ordering::SeqCst);
    }

    /// Move forward by `by` microseconds.
    pub fn advance(&self, by: Micros) {
        self.now.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Micros {
        self.now.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(5);
        let b = a.clone();
        a.advance(10);
        assert_eq!(b.now(), 15);
        b.set(3);
        assert_eq!(a.now(), 3);
    }

    #[test]
    fn system_clock_is_after_2020() {
        // 2020-01-01 in microseconds: a sanity check on the unit, not timing.
        assert!(SystemClock.now() > 1_577_836_800 * MICROS_PER_SEC);
    }
}
