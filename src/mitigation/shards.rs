//! Key sharding: one hot key's limit, split over S sub-buckets on S slots.
//!
//! A deny cache spares the store a key that is over its limit, leases a
//! key that is admitted; both still send every call they do make for that
//! key to one slot, so one node. With `shards = S` on a policy, a key of
//! that policy (or only the keys named in `shard_keys`) is S buckets, each
//! with `burst / S` tokens (rounded down) refilled at `rate / S`, and each
//! request is decided by exactly one of them, in one call as unsharded.
//!
//! **Where the sub-buckets live.** Sub-bucket `i` of a key is another
//! bucket key, derived from the key and `i` alone (never from the topology,
//! which instances may see differently during a slot move: two instances
//! must always mean the same S buckets). Its hash tag is chosen so that its
//! cluster slot falls in the middle half of the i-th S-th of the slot
//! space: a cluster whose masters hold equal contiguous ranges (what
//! `redis-cli --cluster create` makes) with S masters then serves each
//! sub-bucket on a different node, and any layout serves them on S
//! different slots. The derivation tries salts until one lands there
//! (about 2S tries of a hash and a CRC16, well under a microsecond for
//! the S ≤ 16 allowed).
//!
//! **How a request picks one.** Round robin, per key (a counter among a
//! fixed 1024, chosen by the key's hash: keys that share a counter only
//! interleave their turns). Every instance spreads its own requests for
//! the key evenly, so the sub-buckets drain and refill level.
//!
//! **What it costs in accuracy.** Never over-admission: in any interval
//! `t`, sub-bucket `i` admits at most `burst/S + rate·t/S`, so all of them
//! together at most `burst + rate·t`, which is what one exact bucket allows
//! (`src/mitigation/tests/shards.rs` feeds everything a fleet admitted to one
//! exact bucket). Under-admission, measured (docs/hot-keys.md): the
//! `burst mod S` tokens the rounding drops, and a request that finds its
//! sub-bucket empty while another still holds tokens (a burst larger than
//! a sub-bucket arriving faster than the round robin levels it, or
//! requests of mixed cost).
//!
//! **What a client sees.** The policy's limit; the remaining tokens are
//! the sub-bucket's times S (the sub-buckets are level); `Retry-After` and
//! the reset are the sub-bucket's. While Redis is away each sub-bucket has
//! its local share, as any bucket.
//!
//! **Switching.** The sub-buckets are new buckets: turning sharding on (or
//! changing S) starts the key full again, once, and while a reload rolls
//! over the fleet, instances that switched and instances that did not
//! decide on different buckets, so the key may get up to twice its limit
//! until the last instance reloads.

use crate::algorithm::{Decision, Limit, LimitError};
use crate::key::{BucketKey, SLOTS};
use crate::store::{Check, CheckFuture, Checked, Layer, Store};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The most sub-buckets a key may be split into.
pub const MAX_SHARDS: u16 = 16;

const COUNTERS: usize = 1024;

/// The limit of one of `shards` sub-buckets of `limit`: `burst / shards`
/// tokens (rounded down), refilled at `rate / shards` (exactly: the same
/// rate over a period `shards` times as long).
pub fn shard_limit(limit: &Limit, shards: u16) -> Result<Limit, LimitError> {
    let shards = u64::from(shards.max(1));
    let period = Duration::from_micros(limit.units_per_token().saturating_mul(shards));
    Limit::new(limit.burst() / shards, limit.rate_units_per_us(), period)
        .map(|l| l.with_algorithm(limit.algorithm()))
}

/// The finalizer of SplitMix64: a fixed bijection that spreads every input
/// bit over the output. Fixed on purpose: every instance, and every
/// version, must derive the same sub-buckets.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sub-bucket `index` of `shards` of `key`: a bucket key whose slot lies in
/// the middle half of the `index`-th `shards`-th of the slot space. A pure
/// function of its arguments.
pub fn shard_key(key: BucketKey, index: u16, shards: u16) -> BucketKey {
    let shards = u32::from(shards.max(1));
    let width = SLOTS as u32 / shards;
    let low = u32::from(index) * width + width / 4;
    let high = low + width / 2;
    let (hi, lo) = ((key.0 >> 64) as u64, key.0 as u64);
    let mut salt = u64::from(index) << 32;
    loop {
        let seed = mix(salt ^ 0x5348_4152_4453_0000);
        let sub = BucketKey(
            (u128::from(mix(hi ^ seed)) << 64) | u128::from(mix(lo ^ seed.rotate_left(17))),
        );
        if (low..high).contains(&u32::from(sub.slot())) {
            return sub;
        }
        salt += 1;
    }
}

/// A store wrapper splitting the keys of sharded policies over
/// sub-buckets. See the module docs.
#[derive(Debug)]
pub struct Sharded<S> {
    inner: S,
    turns: Box<[AtomicU32]>,
}

impl<S> Sharded<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            turns: (0..COUNTERS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// The sub-bucket the next request for `key` goes to.
    fn pick(&self, key: BucketKey, shards: u16) -> u16 {
        let turn = self.turns[(key.0 as usize) % COUNTERS].fetch_add(1, Ordering::Relaxed);
        (turn % u32::from(shards)) as u16
    }
}

/// The sub-bucket's answer as the whole key's: the policy's limit, the
/// remaining tokens scaled up (the sub-buckets are level). A local share's
/// answer (another limit) is left as it is: that is what decided.
fn as_whole(checked: Checked, sub: Limit, check: &Check, shards: u16) -> Checked {
    if checked.limit != sub {
        return checked;
    }
    let whole = check.limit.burst();
    Checked {
        decision: checked.decision.map(|d| Decision {
            limit: whole,
            remaining: d.remaining.saturating_mul(u64::from(shards)).min(whole),
            ..d
        }),
        limit: check.limit,
        ..checked
    }
}

impl<S: Store> Layer for Sharded<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }

    fn check_through(&self, check: Check) -> CheckFuture<'_> {
        if check.shards <= 1 {
            return self.inner.check(check);
        }
        let Ok(sub) = shard_limit(&check.limit, check.shards) else {
            // Validation refuses such a policy; never split what cannot be.
            return self.inner.check(check);
        };
        let key = shard_key(check.key, self.pick(check.key, check.shards), check.shards);
        let inner = Check {
            key,
            limit: sub,
            ..check
        };
        self.inner.check(inner).map(move |result| {
            result.map(|checked| Checked {
                shard: Some(key),
                ..as_whole(checked, sub, &check, check.shards)
            })
        })
    }
}
