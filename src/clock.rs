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
            .map(|d| d.as_secs() * MICROS_PER_SEC + u64::from(d.subsec_micros()))
            .unwrap_or(0)
    }
}

/// The wall clock, read through the CPU's time-stamp counter.
///
/// `SystemTime::now()` is a `clock_gettime` call, which on a virtual
/// machine can cost more than the whole in-memory check. This clock reads
/// the TSC through `quanta` (as governor does), which costs much less,
/// and adds an offset to the wall clock (compared in
/// docs/bench-memory.md). Two things keep it honest:
/// - it re-reads the wall clock at least every `resync` (1 s by default),
///   so TSC calibration error and NTP slewing cannot accumulate: instances
///   sharing state in Redis stay as close as their wall clocks are;
/// - a re-sync may step time back by that small error, which the algorithms
///   already treat as "no time passed".
///
/// Without a usable TSC, quanta falls back to the OS monotonic clock.
#[derive(Debug)]
pub struct FastClock {
    clock: quanta::Clock,
    /// Raw counter value at construction.
    origin: u64,
    resync: Micros,
    /// Wall-clock micros at `origin`, as of the last re-sync.
    offset: AtomicU64,
    /// Monotonic micros since `origin` at which to re-sync next.
    next_sync: AtomicU64,
}

impl Default for FastClock {
    fn default() -> Self {
        Self::with_resync(std::time::Duration::from_secs(1))
    }
}

impl FastClock {
    /// A clock that re-reads the wall clock at least every `resync`.
    pub fn with_resync(resync: std::time::Duration) -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        let wall = SystemClock.now();
        Self {
            clock,
            origin,
            resync: u64::try_from(resync.as_micros()).unwrap_or(u64::MAX),
            offset: AtomicU64::new(wall),
            next_sync: AtomicU64::new(0),
        }
    }

    #[inline]
    fn monotonic_micros(&self) -> Micros {
        // Raw counter and one scaling: the cheapest read quanta offers.
        self.clock.delta_as_nanos(self.origin, self.clock.raw()) / 1_000
    }
}

impl FastClock {
    /// The once-a-second path of [`FastClock::now`], out of line so the
    /// every-check path stays a counter read, a compare and an add (with
    /// it inline, `now` would keep a stack frame for `SystemTime` on every
    /// call).
    #[cold]
    #[inline(never)]
    fn resync(&self, mono: Micros, due: Micros) -> Option<Micros> {
        // One caller re-syncs; the others keep the previous offset meanwhile.
        self.next_sync
            .compare_exchange(
                due,
                mono.saturating_add(self.resync),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .ok()?;
        let wall = SystemClock.now();
        self.offset
            .store(wall.saturating_sub(mono), Ordering::Relaxed);
        Some(wall)
    }
}

impl Clock for FastClock {
    #[inline]
    fn now(&self) -> Micros {
        let mono = self.monotonic_micros();
        let due = self.next_sync.load(Ordering::Relaxed);
        if mono >= due
            && let Some(wall) = self.resync(mono, due)
        {
            return wall;
        }
        self.offset.load(Ordering::Relaxed).saturating_add(mono)
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
    fn fast_clock_tracks_the_wall_clock() {
        // Re-syncing on every call, it must fall between two wall readings.
        let always = FastClock::with_resync(std::time::Duration::ZERO);
        for _ in 0..1000 {
            let before = SystemClock.now();
            let t = always.now();
            let after = SystemClock.now();
            assert!((before..=after).contains(&t), "{before} <= {t} <= {after}");
        }
        // Between re-syncs it runs on the TSC: a correctness bound (not a
        // timing one) of 50 ms against the wall clock, far above TSC error.
        let fast = FastClock::default();
        for _ in 0..1000 {
            let before = SystemClock.now();
            let t = fast.now();
            let after = SystemClock.now();
            assert!(
                t + 50_000 >= before && t <= after + 50_000,
                "{before} {t} {after}"
            );
        }
    }

    #[test]
    fn system_clock_is_after_2020() {
        // 2020-01-01 in microseconds: a sanity check on the unit, not timing.
        assert!(SystemClock.now() > 1_577_836_800 * MICROS_PER_SEC);
    }
}
