//! The deny cache: a denial from the store, remembered until it expires.
//!
//! A denial says "not until `retry_after`" exactly: a request of the same
//! cost at `now + retry_after` is admitted, one a microsecond earlier is
//! not. Until then nothing can make that bucket admit such a request
//! sooner: refill is a function of time alone, other instances' admissions
//! only take tokens away, and a denial writes nothing. So the instance can
//! answer every request of at least that cost, for that key and that
//! limit, with a 429 of its own until then, and ask the store nothing:
//!
//! - it never admits anything (it only denies, or passes the check down);
//! - for requests of the same cost it denies nothing the store would
//!   admit; a request that costs less is passed down, since fewer tokens
//!   may already be there.
//!
//! `src/mitigation/tests/mod.rs` checks both against the exact cores, for every
//! algorithm, one instance and several. Not remembered: anything but the
//! backend store's own answers (a local share's denial is not a fact about
//! the shared bucket). A denial under a hand-back ceiling
//! ([`Checked::bounded`]) is remembered like any other: the ceiling refills
//! at the policy's rate, as the shared bucket does, so the denial holds as
//! long as it says. It must be: a node so busy that checks miss their
//! deadline puts every answer after it under a ceiling, and that node is
//! the one a hot key's denials should stop reaching.
//!
//! The answer's `RateLimit` fields come from the remembered denial:
//! `Retry-After` and the reset shrink with time exactly; the remaining
//! tokens are those at the denial (tokens refill meanwhile, so the true
//! count can only be higher, and still below the cost).
//!
//! Memory is bounded: at most `max_keys` denials, in shards; a full shard
//! drops its expired entries, and if none have expired, remembers nothing
//! new (the store then decides, as without a cache).

use super::table::{KeyTable, micros};
use crate::algorithm::{Decision, Limit};
use crate::clock::Micros;
use crate::store::{Check, CheckFuture, Checked, Layer, Source, Store};
use std::time::Duration;

/// One remembered denial.
#[derive(Debug, Clone, Copy)]
struct Denial {
    limit: Limit,
    cost: u64,
    /// When a request of `cost` is admitted again.
    retry_at: Micros,
    /// When the full limit is back (as the store said then).
    reset_at: Micros,
    /// The decision's limit and remaining tokens.
    decision: Decision,
}

/// A store wrapper answering checks from the denials it remembers. See the
/// module docs.
#[derive(Debug)]
pub struct DenyCache<S> {
    inner: S,
    denials: KeyTable<Denial>,
}

impl<S> DenyCache<S> {
    /// Wraps `inner`, remembering at most about `max_keys` denials.
    pub fn new(inner: S, max_keys: usize) -> Self {
        Self {
            inner,
            denials: KeyTable::new(max_keys),
        }
    }

    /// The remembered denial answering `check`, if one holds.
    fn answer(&self, check: &Check) -> Option<Checked> {
        let denial = *self.denials.shard(check.key).get(&check.key)?;
        let holds =
            denial.limit == check.limit && check.cost >= denial.cost && check.now < denial.retry_at;
        holds.then(|| {
            Checked::decided(
                Decision {
                    allowed: false,
                    limit: denial.decision.limit,
                    remaining: denial.decision.remaining,
                    retry_after: Duration::from_micros(denial.retry_at - check.now),
                    reset: Duration::from_micros(denial.reset_at.saturating_sub(check.now)),
                },
                check.limit,
                Source::DenyCache,
            )
        })
    }

    /// Learns from the store's answer to `check`.
    pub(super) fn learn(&self, check: &Check, checked: &Checked) {
        let Some(decision) = checked.decision else {
            return;
        };
        let from_store = matches!(checked.source, Source::Redis | Source::Memory);
        if !from_store || checked.limit != check.limit {
            return;
        }
        let mut shard = self.denials.shard(check.key);
        if decision.allowed {
            shard.remove(&check.key);
            return;
        }
        if decision.retry_after.is_zero() {
            return;
        }
        if !self
            .denials
            .room(&mut shard, check.key, |d| d.retry_at > check.now)
        {
            return;
        }
        shard.insert(
            check.key,
            Denial {
                limit: check.limit,
                cost: check.cost,
                retry_at: check.now.saturating_add(micros(decision.retry_after)),
                reset_at: check.now.saturating_add(micros(decision.reset)),
                decision,
            },
        );
    }

    /// Denials remembered now (expired ones included until swept).
    pub fn len(&self) -> usize {
        self.denials.len()
    }

    /// Whether no denial is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<S: Store> Layer for DenyCache<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        if !check.deny_cache {
            return self.inner.check(check);
        }
        if let Some(answer) = self.answer(&check) {
            return CheckFuture::ready(Ok(answer));
        }
        self.inner.check(check).map(move |result| {
            if let Ok(checked) = &result {
                self.learn(&check, checked);
            }
            result
        })
    }
}
