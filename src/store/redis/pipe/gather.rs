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
//! light load through a slow round trip several calls wait at once yet
//! arrive apart; yielding for each cost the service 1.5 futex calls and
//! 10-25 us of CPU per request (docs/redis.md).
//!
//! So the choice is kept here, pure (no socket, no runtime), and told what
//! happened: [`Gather::read`] after each read that handed out replies, and
//! [`Gather::take_now`] when commands wait to be written.

/// While yielding gathers nothing, one hint in this many is still taken,
/// to notice when it would again. Each costs about what a wasted yield
/// does; at a light load one in 8 was still most of what the hint cost
/// (docs/redis.md). Under load, a yield after a read that answered
/// several calls tells as well.
pub(super) const PROBE_EVERY: u8 = 64;

/// The driver's memory of what its yields did.
#[derive(Debug)]
pub(super) struct Gather {
    /// Replies the last read handed out: more than one means calls
    /// overlap, several callers were just woken, and their next commands
    /// are likely on the way.
    delivered: usize,
    /// Set while the driver lets the tasks ready to run go first: how many
    /// bytes were queued when it yielded. More at its next turn means the
    /// yield gathered commands.
    yielded_at: Option<usize>,
    /// Whether the last yield gathered any.
    gathered: bool,
    /// Times other calls in flight hinted at a yield since the driver last
    /// took the hint.
    hints: u8,
}

impl Default for Gather {
    fn default() -> Self {
        Self {
            delivered: 0,
            yielded_at: None,
            // Until a yield shows otherwise.
            gathered: true,
            hints: 0,
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
    /// When to yield:
    /// - the last read answered several calls: calls overlap, and callers
    ///   were just woken. Yield.
    /// - no other call in flight: nothing else is coming. A lone check is
    ///   written at once.
    /// - other calls in flight: only a hint. It is taken while yielding
    ///   gathers commands, and otherwise one time in [`PROBE_EVERY`]. It
    ///   matters when a read's answers came in parts: the next commands
    ///   then start a batch without the first sign.
    pub(super) fn take_now(&mut self, queued: usize, waiting: usize) -> bool {
        if let Some(at_yield) = self.yielded_at.take() {
            self.gathered = queued > at_yield;
            return true;
        }
        if self.should_yield(waiting) {
            self.yielded_at = Some(queued);
            return false;
        }
        true
    }

    fn should_yield(&mut self, waiting: usize) -> bool {
        if self.delivered > 1 {
            return true;
        }
        if waiting <= 1 {
            return false;
        }
        self.hints += 1;
        if self.gathered || self.hints >= PROBE_EVERY {
            self.hints = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One command's bytes, as the tests queue them.
    const CMD: usize = 40;

    #[test]
    fn a_lone_call_is_written_at_once() {
        let mut gather = Gather::default();
        for _ in 0..1000 {
            assert!(gather.take_now(CMD, 1));
            gather.read(1);
        }
    }

    #[test]
    fn a_read_that_answered_several_yields_once_then_takes() {
        let mut gather = Gather::default();
        gather.read(16);
        assert!(!gather.take_now(CMD, 16), "callers were just woken: yield");
        assert!(
            gather.take_now(16 * CMD, 16),
            "the next turn takes what the yield gathered"
        );
    }

    #[test]
    fn the_hint_is_taken_while_yields_gather() {
        let mut gather = Gather::default();
        gather.read(1);
        for _ in 0..100 {
            assert!(!gather.take_now(CMD, 2), "calls in flight: yield");
            assert!(gather.take_now(2 * CMD, 2), "and it gathered one more");
        }
    }

    #[test]
    fn while_yields_gather_nothing_the_hint_is_probed_one_time_in_probe_every() {
        let mut gather = Gather::default();
        gather.read(1);
        // The first hint is taken (nothing says yet that it does not pay)
        // and gathers nothing.
        assert!(!gather.take_now(CMD, 2));
        assert!(gather.take_now(CMD, 2));
        let mut yields = 0;
        let turns = 10 * usize::from(PROBE_EVERY);
        for _ in 0..turns {
            if !gather.take_now(CMD, 2) {
                yields += 1;
                assert!(gather.take_now(CMD, 2), "a yield is followed by a take");
            }
        }
        assert_eq!(yields, 10);
    }

    #[test]
    fn a_probe_that_gathers_makes_the_hint_trusted_again() {
        let mut gather = Gather::default();
        gather.read(1);
        assert!(!gather.take_now(CMD, 2));
        assert!(gather.take_now(CMD, 2), "gathered nothing");
        let mut turns = 0;
        while gather.take_now(CMD, 2) {
            turns += 1;
            assert!(turns < usize::from(PROBE_EVERY), "the probe never came");
        }
        assert!(gather.take_now(2 * CMD, 2), "the probe gathered");
        assert!(!gather.take_now(CMD, 2), "so the next hint is taken");
    }

    #[test]
    fn a_read_that_answered_several_yields_even_when_the_hint_is_distrusted() {
        let mut gather = Gather::default();
        gather.read(1);
        assert!(!gather.take_now(CMD, 2));
        assert!(gather.take_now(CMD, 2), "gathered nothing");
        assert!(gather.take_now(CMD, 2), "the hint is distrusted");
        gather.read(3);
        assert!(!gather.take_now(CMD, 3));
    }
}
