//! Token leases: a hot key that is legitimately admitted, spent locally.
//!
//! A deny cache helps a key that is over its limit; a key admitted a
//! thousand times a second still costs a thousand Redis calls. With
//! `lease = N` on a policy, an instance that must ask the shared bucket
//! asks, in that one call, for its request and for up to `N - cost` tokens
//! more (a [`TakeUpTo`]: the same script, the same atomic step), and spends
//! what it was granted on the next requests for that key without asking
//! again. The take grants what the bucket has, at most that many: it never
//! fails for want of a whole lease, so a lease never costs a call of its
//! own.
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
//! the lease lives exactly that long. Held or shared, every token is then
//! one the exact bucket would have had: `src/mitigation/tests/leases.rs`
//! feeds everything a fleet admitted, in any interleaving, to one exact
//! bucket, which must admit it all.
//!
//! **Only when it can be held.** Tokens taken from a nearly full bucket
//! could not be held, and would be lost. So the take asks the store to
//! grant anything beyond the cost only if the bucket is left with at most
//! `B - 2 - K × N` whole tokens (fewer if more than a token refills each
//! microsecond), where the lease has room to live; else it
//! grants the request alone, exactly as without leases. The store decides
//! that on the bucket as it is, in the same step: nothing is guessed from
//! an older answer, and a key checked now and then (a full bucket) is
//! decided exactly as without leases.
//!
//! **Unused tokens expire**, they are never handed back: giving tokens
//! back is a second call and a race with the refill. What expires is
//! under-admission, at most `N - 1` tokens per instance per lease,
//! measured against one exact bucket fed the same requests (docs/hot-keys.md).
//!
//! **When Redis goes away**, tokens already held are still spent until
//! their lease expires: they were taken from the shared bucket, so this
//! adds nothing to what the failure mode admits. The take is the request's
//! own check, with its policy's failure mode; a local share's answer
//! grants nothing beyond the cost, so no lease is ever taken from it.
//!
//! Only the token bucket leases (validation refuses others), and only a
//! request cheaper than the lease.

use super::table::{KeyTable, micros};
use crate::algorithm::token_bucket::TakeUpTo;
use crate::algorithm::{Decision, Limit};
use crate::clock::Micros;
use crate::key::BucketKey;
use crate::store::{Check, CheckFuture, Checked, Layer, Source, Store};

/// What this instance holds of one key.
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
    /// A take for this key is in flight: others go without one rather than
    /// take a second lease (which would replace, and so waste, the first).
    taking: bool,
}

/// Clears a key's `taking` when its take ends, however it ends.
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

/// The take for a request of `cost` leasing `lease` under `limit`: the
/// rest of the lease, granted only while it can live (`lease_life` of the
/// remaining tokens is positive); `None` when a lease never could.
pub fn lease_take(limit: &Limit, cost: u64, lease: u64, instances: u64) -> Option<TakeUpTo> {
    let extra = lease.checked_sub(cost).filter(|extra| *extra > 0)?;
    // lease_life(R) > 0 exactly while the room B - (R + 1) - K x N refills
    // for at least a microsecond: at least ceil(rate / unit) tokens (one,
    // unless more than a token refills each microsecond).
    let least_room = limit
        .rate_units_per_us()
        .max(1)
        .div_ceil(limit.units_per_token());
    let leave = limit.burst().checked_sub(
        instances
            .checked_mul(lease)?
            .checked_add(1)?
            .checked_add(least_room)?,
    )?;
    Some(TakeUpTo { extra, leave })
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
            retry_after: std::time::Duration::ZERO,
            reset: std::time::Duration::from_micros(held.reset_at.saturating_sub(check.now)),
        };
        Some(Checked::decided(decision, check.limit, Source::Lease))
    }

    /// Marks `check`'s key as taking a lease, unless a take is in flight
    /// already or the table has no room; whether it did.
    fn start_taking(&self, check: &Check) -> bool {
        let mut shard = self.held.shard(check.key);
        // What a full table forgets: keys neither holding nor taking.
        if !self
            .held
            .room(&mut shard, check.key, |h| h.taking || h.until > check.now)
        {
            return false;
        }
        let held = shard.entry(check.key).or_insert(Held {
            limit: check.limit,
            tokens: 0,
            until: 0,
            shared: 0,
            reset_at: 0,
            taking: false,
        });
        !std::mem::replace(&mut held.taking, true)
    }

    /// Holds the `extra` tokens a take of `lease` was granted, as long as
    /// the store's answer lets them live; returns how many are held.
    fn hold(&self, check: &Check, lease: u64, extra: u64, decision: &Decision) -> u64 {
        let life = lease_life(&check.limit, decision.remaining, lease, self.instances);
        let kept = if life == 0 { 0 } else { extra };
        if let Some(held) = self.held.shard(check.key).get_mut(&check.key) {
            *held = Held {
                limit: check.limit,
                tokens: kept,
                until: check.now.saturating_add(life),
                shared: decision.remaining,
                reset_at: check.now.saturating_add(micros(decision.reset)),
                taking: held.taking,
            };
            return kept;
        }
        0
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
        let lease = check.lease.min(check.limit.burst());
        let Some(take) = lease_take(&check.limit, check.cost, lease, self.instances)
            .filter(|_| self.start_taking(&check))
        else {
            // No lease to be had: the request alone, as without leases.
            return self.inner.check(check);
        };
        let taking = Taking {
            leases: self,
            key: check.key,
        };
        self.inner.check(check.taking(take)).map(move |result| {
            let held = match &result {
                Ok(Checked {
                    decision: Some(decision),
                    source: Source::Redis | Source::Memory,
                    extra,
                    ..
                }) if *extra > 0 => {
                    let kept = self.hold(&check, lease, *extra, decision);
                    Some(Decision {
                        remaining: decision.remaining.saturating_add(kept).min(decision.limit),
                        ..*decision
                    })
                }
                _ => None,
            };
            drop(taking);
            match (result, held) {
                (Ok(checked), Some(shown)) => Ok(Checked {
                    decision: Some(shown),
                    ..checked
                }),
                (result, _) => result,
            }
        })
    }
}
