//! Whether the connection's driver writes the commands queued now, or
//! first lets the tasks ready to run queue theirs.
//!
//! Why it would wait: a caller that finds the driver idle wakes it, and a
//! task woken by the task running goes to tokio's LIFO slot and runs next.
//! Written at once, that one command costs a syscall, and a wake-up of
//! Redis, while other tasks ready to run (callers a read just woke,
//! requests whose sockets turned readable together) were about to queue
//! theirs. One turn later they go out together.
//!
//! Why it would not: a yield is not free. A task that wakes itself counts
//! for tokio as yielding, and an idle worker is woken to share the queue
//! (a futex wake, and a worker that finds nothing and parks again). At a
//! light load through a slow round trip several calls are in flight at
//! once yet arrive apart, and a read sometimes answers two of them; each
//! is a sign that more commands are coming, true under a saturating load
//! and almost never there (docs/performance.md, "Client side of a Redis
//! check").
//!
//! So the signs are trusted only while the yields they cause gather
//! commands: the driver is told what happened ([`Gather::read`] after each
//! read that handed out replies) and asked, when commands wait to be
//! written, [`Gather::take_now`]. Kept pure (no socket, no runtime), so
//! the tests below drive it turn by turn.

/// A yield that gathered commands sets the credit back to this many
/// yields on a sign; each that gathers nothing spends one. Several,
/// because a miss is not always a loss: with two workers the other one
/// often queues commands before the driver yields, so under concurrency
/// many yields gather nothing and a small credit would run out and stop
/// the batching that pays for them (docs/performance.md, "Client side of
/// a Redis check"). And under any load a round's replies may be read in
/// two parts, the second answering one call; were that to stop the
/// batching, the next round's commands would go out one by one, their
/// replies too, and the split would carry on.
const CREDIT: u8 = 8;

/// With the credit spent, one sign in this many is still taken, to notice
/// when yielding would gather again. Each costs about what a wasted yield
/// does, so probes are rare enough that at a light load they cost little
/// (docs/performance.md, "Client side of a Redis check").
const PROBE_EVERY: u8 = 64;

/// The driver's memory of what its yields did.
#[derive(Debug)]
pub(super) struct Gather {
    /// Replies the last read handed out: more than one means calls
    /// overlap, and several callers were just woken.
    delivered: usize,
    /// Set while the driver lets the tasks ready to run go first: how many
    /// bytes were queued when it yielded. More at its next turn means the
    /// yield gathered commands.
    yielded_at: Option<usize>,
    /// Yields left to take on a sign before only probing.
    credit: u8,
    /// Signs since the driver last took one.
    signs: u8,
}

impl Default for Gather {
    fn default() -> Self {
        Self {
            delivered: 0,
            yielded_at: None,
            // The first sign is taken, and what it gathers decides.
            credit: 1,
            signs: 0,
        }
    }
}

impl Gather {
    /// A read handed out `replies` replies (at least one).
    pub(super) fn read(&mut self, replies: usize) {
        self.delivered = replies;
    }

    /// Commands are queued (`queued` bytes), the last write is done, and
    /// `waiting` calls are in flight (those queued included): `true` to
    /// take them now, `false` to yield once first. After a yield the next
    /// call always says take.
    ///
    /// A sign that more commands are coming: the last read answered
    /// several calls (their callers were just woken), or other calls are in
    /// flight. Without one (a lone check) the commands are taken at once.
    /// With one the driver yields while it has credit, and otherwise one
    /// time in [`PROBE_EVERY`].
    pub(super) fn take_now(&mut self, queued: usize, waiting: usize) -> bool {
        if let Some(at_yield) = self.yielded_at.take() {
            self.credit = if queued > at_yield {
                CREDIT
            } else {
                self.credit.saturating_sub(1)
            };
            return true;
        }
        if self.delivered <= 1 && waiting <= 1 {
            return true;
        }
        self.signs += 1;
        if self.credit > 0 || self.signs >= PROBE_EVERY {
            self.signs = 0;
            self.yielded_at = Some(queued);
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One command's bytes, as the tests queue them.
    const CMD: usize = 40;

    /// Yields the driver makes over `turns` turns that each find one
    /// command queued and `waiting` calls in flight, no yield gathering.
    fn yields_gathering_nothing(gather: &mut Gather, turns: usize, waiting: usize) -> usize {
        let mut yields = 0;
        for _ in 0..turns {
            if !gather.take_now(CMD, waiting) {
                yields += 1;
                assert!(
                    gather.take_now(CMD, waiting),
                    "a yield is followed by a take"
                );
            }
        }
        yields
    }

    #[test]
    fn a_lone_call_is_written_at_once() {
        let mut gather = Gather::default();
        for _ in 0..1000 {
            gather.read(1);
            assert!(gather.take_now(CMD, 1));
        }
    }

    #[test]
    fn a_read_that_answered_several_yields_once_then_takes() {
        let mut gather = Gather::default();
        gather.read(16);
        assert!(!gather.take_now(CMD, 1), "callers were just woken: yield");
        assert!(
            gather.take_now(16 * CMD, 16),
            "the next turn takes what the yield gathered"
        );
    }

    #[test]
    fn signs_are_taken_while_yields_gather() {
        let mut gather = Gather::default();
        gather.read(1);
        for _ in 0..100 {
            assert!(!gather.take_now(CMD, 2), "calls in flight: yield");
            assert!(gather.take_now(2 * CMD, 2), "and it gathered one more");
        }
    }

    #[test]
    fn while_yields_gather_nothing_a_sign_is_probed_one_time_in_probe_every() {
        let mut gather = Gather::default();
        assert_eq!(yields_gathering_nothing(&mut gather, 1, 2), 1, "the first");
        assert!(gather.take_now(CMD, 2), "the credit was one yield");
        let turns = 10 * usize::from(PROBE_EVERY);
        assert_eq!(yields_gathering_nothing(&mut gather, turns, 2), 10);
        // A read that answered several is a sign like any other.
        gather.read(2);
        assert_eq!(yields_gathering_nothing(&mut gather, turns, 1), 10);
    }

    #[test]
    fn misses_short_of_the_credit_keep_the_batching() {
        let mut gather = Gather::default();
        for _ in 0..100 {
            gather.read(8);
            assert!(!gather.take_now(CMD, 8));
            assert!(gather.take_now(8 * CMD, 8), "a round gathered");
            for _ in 1..CREDIT {
                gather.read(1);
                assert!(!gather.take_now(CMD, 8), "a split read: still a sign");
                assert!(gather.take_now(CMD, 8), "this yield gathered nothing");
            }
        }
    }

    #[test]
    fn a_probe_that_gathers_restores_the_credit() {
        let mut gather = Gather::default();
        let credit = usize::from(CREDIT);
        assert_eq!(yields_gathering_nothing(&mut gather, 1, 2), 1);
        let mut turns = 0;
        while gather.take_now(CMD, 2) {
            turns += 1;
            assert!(turns < usize::from(PROBE_EVERY), "the probe never came");
        }
        assert!(gather.take_now(2 * CMD, 2), "the probe gathered");
        assert_eq!(yields_gathering_nothing(&mut gather, credit, 2), credit);
        assert!(gather.take_now(CMD, 2), "and the credit is spent again");
    }
}
