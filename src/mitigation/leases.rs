//! Token leases: a hot key that is legitimately admitted, spent locally.
//!
//! A deny cache helps a key that is over its limit; a key admitted a
//! thousand times a second still costs a thousand Redis calls. With
//! `lease = N` on a policy, an instance that must ask the shared bucket
//! takes N tokens in that one call (one check of cost N: the same script,
//! the same atomic step) and spends them on the next requests for that key
//! without asking again.
//!
//! **Never more than one exact bucket.** Tokens are spent only after they
//! left the shared bucket, so the fleet never spends more than it took.
//! But a held token must not outlive the moment the shared bucket would
//! have been full without it: a full bucket wastes its refill, and tokens
//! held aside would then add to a burst the exact bucket would not have.
//! So a lease expires before that can happen. Right after the take, the
//! shared bucket holds at most `R + 1` tokens (`R`, the remaining whole
//! tokens the script reports) and the whole fleet holds at most `K × N`
//! (`K` instances, `failure.instances`); together they stay under the
//! burst `B` for `(B - (R + 1) - K × N)` tokens' worth of refill time, and
//! the lease lives exactly that long (not at all if that is not positive:
//! the request's own cost is spent and the rest is dropped). Held or
//! shared, every token is then one the exact bucket would have had:
//! `src/mitigation/tests/leases.rs` feeds everything a fleet admitted, in any
//! interleaving, to one exact bucket, which must admit it all.
//!
//! **Only when it can be held.** A lease taken from a bucket that is
//! nearly full could not be held, and its tokens would be lost. So the
//! instance remembers each key's last answer (its remaining tokens and
//! when) and takes a lease only when even the fullest the bucket can be
//! by now, less the lease, leaves the lease room to live; otherwise it
//! asks for the request alone, as without leases. A key checked now and
//! then stays exactly as without leases; a key drained by heavy traffic
//! gets leases.
//!
//! **Unused tokens expire**, they are never handed back: giving tokens
//! back is a second call and a race with the refill. What expires is
//! under-admission, at most `N - 1` tokens per instance per lease,
//! measured against one exact bucket fed the same requests (docs/hot-keys.md).
//!
//! **When Redis goes away**, tokens already held are still spent until
//! their lease expires: they were taken from the shared bucket, so this
//! adds nothing to what the failure mode admits. Taking a lease never
//! falls back: its check goes down with failure mode `closed`, and on any
//! failure the request is asked alone, with its policy's own mode.
//!
//! Only the token bucket leases (validation refuses others), and only a
//! request no dearer than the lease.

use super::table::{KeyTable, micros};
use crate::algorithm::{Decision, Limit};
use crate::clock::Micros;
use crate::key::BucketKey;
use crate::store::{Check, CheckFuture, Checked, FailureMode, Layer, Source, Store};
use std::time::Duration;

/// What this instance knows of one key: tokens it holds (maybe none),
/// and the shared bucket's last answer.
#[derive(Debug, Clone, Copy)]
struct Held {
    limit: Limit,
    /// Leased tokens left (0: none held).
    tokens: u64,
    /// The lease ends here (exclusive).
    until: Micros,
    /// The shared bucket's remaining tokens, as of the lease.
    shared: u64,
    /// When the shared bucket is full again, as of the lease.
    reset_at: Micros,
    /// The shared bucket's remaining whole tokens at its last answer, and
    /// when that was.
    seen: (u64, Micros),
    /// A lease take for this key is in flight: others go alone rather than
    /// take a second lease (which would replace, and so waste, the first).
    taking: bool,
}

/// Clears a key's `taking` when its lease take ends, however it ends.
struct Taking<'a, S> {
    leases: &'a Leases<S>,
    key: BucketKey,
}

impl<S> Drop for Taking<'_, S> {
    fn drop(&mut self) {
        if let Some(held) = self.leases.held.shard(self.key).get_mut(&self.key) {
            held.taking = false;
        }
    }
}

/// A store wrapper spending leased tokens locally. See the module docs.
#[derive(Debug)]
pub struct Leases<S> {
    inner: S,
    instances: u64,
    held: KeyTable<Held>,
}

/// How long a lease of `lease` tokens may be held when the shared bucket
/// reported `remaining` right after it, with `instances` holders at most:
/// the refill time of the room left under the burst. Zero: not at all.
pub fn lease_life(limit: &Limit, remaining: u64, lease: u64, instances: u64) -> Micros {
    let room = limit
        .burst()
        .saturating_sub(remaining.saturating_add(1))
        .saturating_sub(instances.saturating_mul(lease));
    // Units over units per microsecond, rounded down: never a microsecond
    // longer than the room lasts.
    room.saturating_mul(limit.units_per_token()) / limit.rate_units_per_us().max(1)
}

impl<S> Leases<S> {
    /// Wraps `inner` for a fleet of `instances`, holding leases for at most
    /// about `max_keys` keys.
    pub fn new(inner: S, instances: u64, max_keys: usize) -> Self {
        Self {
            inner,
            instances: instances.max(1),
            held: KeyTable::new(max_keys),
        }
    }

    /// Spends held tokens on `check`, if a lease holds enough.
    fn spend(&self, check: &Check) -> Option<Checked> {
        let mut shard = self.held.shard(check.key);
        let held = shard.get_mut(&check.key)?;
        if held.limit != check.limit || check.now >= held.until || held.tokens < check.cost {
            return None;
        }
        held.tokens -= check.cost;
        let decision = Decision {
            allowed: true,
            limit: check.limit.burst(),
            remaining: held
                .shared
                .saturating_add(held.tokens)
                .min(check.limit.burst()),
            retry_after: Duration::ZERO,
            reset: Duration::from_micros(held.reset_at.saturating_sub(check.now)),
        };
        Some(Checked::decided(decision, check.limit, Source::Lease))
    }

    /// Whether a lease of `lease` taken now would surely be held: the
    /// fullest the shared bucket can be by now (its last answer, refilled
    /// since, nothing spent), less the lease, leaves it room to live.
    /// If so, marks the key as taking one.
    fn worth_a_lease(&self, check: &Check, lease: u64) -> bool {
        let mut shard = self.held.shard(check.key);
        let Some(held) = shard
            .get_mut(&check.key)
            .filter(|h| h.limit == check.limit && !h.taking)
        else {
            return false;
        };
        let (remaining, at) = held.seen;
        let limit = &check.limit;
        let refilled = check
            .now
            .saturating_sub(at)
            .saturating_mul(limit.rate_units_per_us())
            .div_ceil(limit.units_per_token());
        let fullest = remaining
            .saturating_add(1)
            .saturating_add(refilled)
            .min(limit.burst());
        let worth =
            fullest >= lease && lease_life(limit, fullest - lease, lease, self.instances) > 0;
        held.taking = worth;
        worth
    }

    /// Remembers the store's answer to a leasing check at `check.now`, and
    /// keeps `tokens` of a lease it granted; returns how many are kept (0:
    /// not held, they are dropped).
    fn learn(&self, check: &Check, lease: u64, tokens: u64, decision: &Decision) -> u64 {
        let life = if tokens == 0 {
            0
        } else {
            lease_life(&check.limit, decision.remaining, lease, self.instances)
        };
        let kept = if life == 0 { 0 } else { tokens };
        let mut shard = self.held.shard(check.key);
        // What a full table forgets: keys holding nothing, seen before the
        // last refill could have filled them.
        let refill = micros(check.limit.refill_time());
        if !self.held.room(&mut shard, check.key, |h| {
            h.until > check.now || h.seen.1.saturating_add(refill) > check.now
        }) {
            return 0;
        }
        let seen = (decision.remaining, check.now);
        match shard.get_mut(&check.key) {
            // A request asked alone beside a held lease: only what it saw.
            Some(held) if kept == 0 && held.limit == check.limit => held.seen = seen,
            _ => {
                let taking = shard.get(&check.key).is_some_and(|h| h.taking);
                shard.insert(
                    check.key,
                    Held {
                        limit: check.limit,
                        tokens: kept,
                        until: check.now.saturating_add(life),
                        shared: decision.remaining,
                        reset_at: check.now.saturating_add(micros(decision.reset)),
                        seen,
                        taking,
                    },
                );
            }
        }
        kept
    }

    /// Keys holding a lease now (expired ones included until swept).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<S: Store> Layer for Leases<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        if check.lease == 0 {
            return self.inner.check(check);
        }
        if let Some(answer) = self.spend(&check) {
            return CheckFuture::ready(Ok(answer));
        }
        CheckFuture::waiting(async move {
            let lease = check.lease.min(check.limit.burst());
            if lease > check.cost && self.worth_a_lease(&check, lease) {
                // One call takes the lease; it never falls back (a local
                // share must not pay for a lease).
                let _taking = Taking {
                    leases: self,
                    key: check.key,
                };
                let take = Check {
                    cost: lease,
                    on_failure: FailureMode::Closed,
                    ..check
                };
                if let Ok(checked) = self.inner.check(take).await
                    && matches!(checked.source, Source::Redis | Source::Memory)
                    && let Some(decision) = checked.decision.filter(|d| d.allowed)
                {
                    let kept = self.learn(&check, lease, lease - check.cost, &decision);
                    let shown = Decision {
                        remaining: decision.remaining.saturating_add(kept).min(decision.limit),
                        ..decision
                    };
                    return Ok(Checked {
                        decision: Some(shown),
                        ..checked
                    });
                }
            }
            // No lease to be had: the request alone, as without leases.
            let result = self.inner.check(check).await;
            if let Ok(Checked {
                decision: Some(decision),
                source: Source::Redis | Source::Memory,
                ..
            }) = &result
            {
                self.learn(&check, lease, 0, decision);
            }
            result
        })
    }

    /// Two calls, one after the other, when a lease is not to be had.
    fn longest_wait(&self) -> Option<Duration> {
        self.inner.longest_wait()?.checked_mul(2)
    }
}
