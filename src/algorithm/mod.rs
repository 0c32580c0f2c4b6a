//! The algorithms, each exact and pure, and the one description of what each
//! needs from the rest of the service.
//!
//! Every algorithm reads the same [`Limit`] (`burst` tokens refilled at
//! `rate` per `period`) and answers with the same [`Decision`], so the HTTP
//! headers and `Retry-After` work for all of them:
//!
//! | algorithm | reads the limit as | state per key | "reset" means |
//! |---|---|---|---|
//! | `token_bucket` ([`token_bucket`]) | `burst`, refilled `rate`/`period` | tokens, last | until the bucket is full |
//! | `gcra` | the same bucket as one instant | theoretical arrival time | until the bucket is full |
//! | `fixed_window` | `burst` requests per window `W` | window, count | until the window's count resets |
//! | `sliding_log` | `burst` requests in any `W` | one timestamp per token | until the log is empty |
//! | `sliding_window` | `burst` requests in any `W`, estimated | window, count, previous count | until the estimate is 0 |
//!
//! `W` is the time the bucket takes to refill from empty ([`Window`]). What
//! each one promises, and where it fails, is in its module and measured by
//! `cargo run -p loadtest -- compare`.
//!
//! Like the bucket, every function takes `now` and the stored state and
//! returns the decision and the state to store; nothing reads a clock. A
//! `now` behind the stored state is treated as the stored instant (no time
//! passes), and waits are measured from the real `now`. GCRA is the one
//! exception, noted there.
//!
//! # Dependencies
//! [`limit`] and [`decision`] are the shared vocabulary (they import nothing
//! of the crate but the clock's unit); each algorithm module imports only
//! them; this module ties them together. Stores, config and the failure
//! policy ask `impl Algorithm` below, never match on algorithms themselves,
//! so adding one means: its core module (with `pack`/`unpack` if its state
//! fits 16 bytes), its script in `lua/`, and its row in each method here.

pub mod decision;
pub mod fixed_window;
pub mod gcra;
pub mod limit;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

pub use decision::{Decision, Packed};
pub use limit::{Algorithm, CostExceedsBurst, Limit, LimitError, MAX_EXACT, Window};

use crate::clock::Micros;
use std::time::Duration;
use token_bucket::BucketState;

/// How a Lua script reads the limit: the ARGV words after `now` and `cost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptArgs {
    words: [u64; 3],
    len: usize,
}

impl ScriptArgs {
    /// The words, in ARGV order.
    pub fn as_slice(&self) -> &[u64] {
        &self.words[..self.len]
    }
}

/// How a local bucket mirrors an algorithm's shared state, so that losing
/// the shared store hands nobody a fresh burst (see [`crate::failover`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mirror {
    /// A bucket: the local one is set to the same time until full.
    TimeToFull,
    /// A window: its "reset" is when its count clears, not a refill; the
    /// local bucket is set to the same fraction of room left.
    RoomLeft,
}

/// A limit an algorithm cannot keep exactly (refused at start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unfit {
    /// The sliding-window counter's exact comparison would leave the
    /// integers doubles hold exactly.
    #[error("burst x window (in microseconds) must not exceed 2^53 for sliding_window")]
    WindowTooLarge,
    /// The sliding log would keep too many members per client.
    #[error(
        "sliding_log keeps one entry per token in the window: burst must be at most {}",
        sliding_log::MAX_BURST
    )]
    LogTooLarge,
}

impl Algorithm {
    /// Its Lua script, as shipped in `lua/` (each opens with its KEYS, ARGV
    /// and reply contract).
    pub fn script(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => include_str!("../../lua/token_bucket.lua"),
            Algorithm::Gcra => include_str!("../../lua/gcra.lua"),
            Algorithm::FixedWindow => include_str!("../../lua/fixed_window.lua"),
            Algorithm::SlidingLog => include_str!("../../lua/sliding_log.lua"),
            Algorithm::SlidingWindow => include_str!("../../lua/sliding_window.lua"),
        }
    }

    /// The tag between the prefix and the hash tag of its Redis keys. Each
    /// algorithm stores a different shape (a sorted set for the log), so
    /// each has its own key space: a policy switched to another algorithm
    /// starts afresh instead of misreading the old value (or failing with
    /// WRONGTYPE).
    pub fn key_tag(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "",
            Algorithm::Gcra => "gcra:",
            Algorithm::FixedWindow => "fw:",
            Algorithm::SlidingLog => "log:",
            Algorithm::SlidingWindow => "sw:",
        }
    }

    /// The limit as its script takes it, after `now` and `cost`: a bucket's
    /// units (unit, rate, capacity) or a window's (limit, window).
    pub fn script_args(self, limit: &Limit) -> ScriptArgs {
        match self {
            Algorithm::TokenBucket | Algorithm::Gcra => ScriptArgs {
                words: [
                    limit.units_per_token(),
                    limit.rate_units_per_us(),
                    limit.capacity_units(),
                ],
                len: 3,
            },
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingWindow => {
                let window = limit.window();
                ScriptArgs {
                    words: [window.limit, window.window_us, 0],
                    len: 2,
                }
            }
        }
    }

    /// Whether a hand-back ceiling applies: a bucket level, so only the
    /// token bucket takes one (its script's last ARGV). The others hand back
    /// without one: their shared state restarts empty after a Redis restart.
    pub fn takes_ceiling(self) -> bool {
        self == Algorithm::TokenBucket
    }

    /// How a local bucket mirrors its shared state.
    pub fn mirror(self) -> Mirror {
        match self {
            Algorithm::TokenBucket | Algorithm::Gcra => Mirror::TimeToFull,
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingWindow => {
                Mirror::RoomLeft
            }
        }
    }

    /// The largest burst whose state fits the in-process store's 16 bytes
    /// ([`Packed`]); `None`: it never fits (the log's state grows with
    /// traffic).
    pub fn max_packed_burst(self) -> Option<u64> {
        match self {
            Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::FixedWindow => Some(u64::MAX),
            // Two counts in one word.
            Algorithm::SlidingWindow => Some(u64::from(u32::MAX)),
            Algorithm::SlidingLog => None,
        }
    }

    /// Whether its state under `limit` fits the in-process store's 16 bytes.
    pub fn packs(self, limit: &Limit) -> bool {
        self.max_packed_burst()
            .is_some_and(|most| limit.burst() <= most)
    }

    /// Whether the racy GET/compute/SET store keeps it: the token bucket
    /// only, since that store exists to measure the race, not to offer
    /// algorithms.
    pub fn has_naive_store(self) -> bool {
        self == Algorithm::TokenBucket
    }

    /// Refuses a limit whose script would leave exact integers or whose
    /// state would grow too large (every store's concern, checked at
    /// start-up).
    pub fn check_limit(self, limit: &Limit) -> Result<(), Unfit> {
        match self {
            Algorithm::SlidingWindow if !sliding_window::exact_in_lua(&limit.window()) => {
                Err(Unfit::WindowTooLarge)
            }
            Algorithm::SlidingLog if limit.burst() > sliding_log::MAX_BURST => {
                Err(Unfit::LogTooLarge)
            }
            _ => Ok(()),
        }
    }
}

/// Any algorithm's stored state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// [`token_bucket`].
    Bucket(BucketState),
    /// [`gcra`].
    Gcra(gcra::GcraState),
    /// [`fixed_window`].
    Fixed(fixed_window::FixedState),
    /// [`sliding_log`].
    Log(sliding_log::LogState),
    /// [`sliding_window`].
    Counter(sliding_window::CounterState),
}

/// Decide one request with the limit's algorithm. `state` is what a store
/// holds for the key (`None`: no key); the result's state is what it should
/// hold afterwards (`None`: no key), exactly as the Lua scripts keep it. A
/// state of another algorithm's shape reads as no key.
pub fn check(
    limit: &Limit,
    state: Option<State>,
    cost: u64,
    now: Micros,
) -> Result<(Decision, Option<State>), CostExceedsBurst> {
    let window = limit.window();
    Ok(match limit.algorithm() {
        Algorithm::TokenBucket => {
            let s = match state {
                Some(State::Bucket(s)) => Some(s),
                _ => None,
            };
            let (d, next) = token_bucket::check(limit, s, cost, now)?;
            // The stores keep no key for a full bucket, and a denial
            // writes nothing.
            let kept = if !d.allowed {
                s
            } else {
                (!d.reset.is_zero()).then_some(next)
            };
            (d, kept.map(State::Bucket))
        }
        Algorithm::Gcra => {
            let s = match state {
                Some(State::Gcra(s)) => Some(s),
                _ => None,
            };
            let (d, s) = gcra::check(limit, s, cost, now)?;
            (d, s.map(State::Gcra))
        }
        Algorithm::FixedWindow => {
            let s = match state {
                Some(State::Fixed(s)) => Some(s),
                _ => None,
            };
            let (d, s) = fixed_window::check(&window, s, cost, now)?;
            (d, s.map(State::Fixed))
        }
        Algorithm::SlidingLog => {
            let s = match state {
                Some(State::Log(s)) => s,
                _ => sliding_log::LogState::default(),
            };
            let (d, s) = sliding_log::check(&window, s, cost, now)?;
            (d, (!s.entries.is_empty()).then_some(State::Log(s)))
        }
        Algorithm::SlidingWindow => {
            let s = match state {
                Some(State::Counter(s)) => Some(s),
                _ => None,
            };
            let (d, s) = sliding_window::check(&window, s, cost, now)?;
            (d, s.map(State::Counter))
        }
    })
}

/// Why the in-process store cannot decide a request ([`check_packable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PackedError {
    /// The request can never fit the limit.
    #[error(transparent)]
    Cost(#[from] CostExceedsBurst),
    /// This algorithm's state does not fit 16 bytes under this limit
    /// ([`Algorithm::packs`]).
    #[error("{} state does not fit the in-process store", .0.as_str())]
    DoesNotPack(Algorithm),
}

/// Refuses what the in-process store cannot decide: a cost above the
/// burst, a state that does not pack (the log). What passes,
/// [`decide_packed`] decides with no error left to carry.
#[inline]
pub fn check_packable(limit: &Limit, cost: u64) -> Result<(), PackedError> {
    let algorithm = limit.algorithm();
    // One branch on the hot path; the reasons are sorted out of line.
    if cost <= limit.burst() && (algorithm == Algorithm::TokenBucket || algorithm.packs(limit)) {
        return Ok(());
    }
    Err(not_packable(limit, cost))
}

#[cold]
#[inline(never)]
fn not_packable(limit: &Limit, cost: u64) -> PackedError {
    let algorithm = limit.algorithm();
    if algorithm.packs(limit) {
        match limit.check_cost(cost) {
            Err(e) => PackedError::Cost(e),
            Ok(()) => PackedError::DoesNotPack(algorithm),
        }
    } else {
        PackedError::DoesNotPack(algorithm)
    }
}

/// One key's packed state in the in-process store: [`decide_in`] runs its
/// state change on it under the store's lock, and builds the decision after.
pub trait PackedSlot {
    /// Runs `step` on the state (`None`: no entry); the state is left
    /// holding what `step` leaves in it.
    fn update<R>(self, step: impl FnOnce(&mut Option<Packed>) -> R) -> R;
}

/// A state held by the caller is a slot with no lock.
impl PackedSlot for &mut Option<Packed> {
    #[inline(always)]
    fn update<R>(self, step: impl FnOnce(&mut Option<Packed>) -> R) -> R {
        step(self)
    }
}

/// [`check`] on a packed state, as the in-process store keeps it, for a
/// request [`check_packable`] accepted: `state` is what the store holds
/// (`None`: no entry) and is left holding what it should keep; a denial
/// leaves it as it was.
///
/// `ceiling` bounds a token bucket's level after refill (see
/// [`token_bucket::check_within`]); other algorithms take none. A packed
/// state is read as stored even past its `full_at` (a sweep drops it), so
/// a clock stepping back into its window still finds it, as in Redis.
#[inline]
pub fn decide_packed(
    limit: &Limit,
    state: &mut Option<Packed>,
    cost: u64,
    now: Micros,
    ceiling: Option<u64>,
) -> Decision {
    decide_in(state, limit, cost, now, ceiling)
}

/// [`decide_packed`] on a store's slot. The token bucket (the hot path)
/// changes its state in the slot and builds its decision after, outside
/// the store's lock and straight where the caller wants it (see
/// [`token_bucket::Spent`]).
#[inline]
pub fn decide_in(
    slot: impl PackedSlot,
    limit: &Limit,
    cost: u64,
    now: Micros,
    ceiling: Option<u64>,
) -> Decision {
    if limit.algorithm() == Algorithm::TokenBucket {
        let ceiling = ceiling.unwrap_or(u64::MAX);
        return slot
            .update(|state| token_bucket::spend_packed(limit, state, cost, now, ceiling))
            .decision(limit, cost);
    }
    slot.update(|state| decide_packed_other(limit, state, cost, now))
}

/// [`decide_in`] taking up to `take` whole tokens beyond the cost (a
/// lease): the decision and the extra tokens granted. Only a token bucket
/// grants any.
#[inline]
pub fn take_in(
    slot: impl PackedSlot,
    limit: &Limit,
    cost: u64,
    now: Micros,
    ceiling: Option<u64>,
    take: token_bucket::TakeUpTo,
) -> (Decision, u64) {
    if limit.algorithm() != Algorithm::TokenBucket {
        return (decide_in(slot, limit, cost, now, ceiling), 0);
    }
    let ceiling = ceiling.unwrap_or(u64::MAX);
    let (spent, extra) = slot
        .update(|state| token_bucket::spend_packed_up_to(limit, state, cost, now, ceiling, take));
    (spent.decision(limit, cost), extra)
}

/// [`decide_packed`] for the other algorithms, through [`State`] (the
/// bucket too, if it ever came this way).
#[inline(never)]
fn decide_packed_other(
    limit: &Limit,
    state: &mut Option<Packed>,
    cost: u64,
    now: Micros,
) -> Decision {
    let algorithm = limit.algorithm();
    let w = limit.window().window_us;
    let unpacked = match (algorithm, *state) {
        (_, None) => None,
        (Algorithm::TokenBucket, Some(p)) => Some(State::Bucket(BucketState::unpack(p, limit))),
        (Algorithm::Gcra, Some(p)) => Some(State::Gcra(gcra::GcraState::unpack(p))),
        (Algorithm::FixedWindow, Some(p)) => {
            Some(State::Fixed(fixed_window::FixedState::unpack(p, w)))
        }
        (Algorithm::SlidingWindow, Some(p)) => {
            Some(State::Counter(sliding_window::CounterState::unpack(p, w)))
        }
        // The log does not pack (`check_packable` refuses it): with no state
        // to keep, deciding would admit everything.
        (Algorithm::SlidingLog, Some(_)) => return refusal(limit),
    };
    if algorithm == Algorithm::SlidingLog {
        return refusal(limit);
    }
    match check(limit, unpacked, cost, now) {
        Ok((decision, next)) => {
            let packed = match next {
                None => Some(None),
                Some(State::Bucket(s)) => Some(Some(s.pack(limit))),
                Some(State::Gcra(s)) => Some(Some(s.pack())),
                Some(State::Fixed(s)) => Some(Some(s.pack())),
                Some(State::Counter(s)) => s.pack().map(Some),
                Some(State::Log(_)) => None,
            };
            match packed {
                Some(kept) => {
                    *state = kept;
                    decision
                }
                // A state that cannot be kept: refuse rather than forget it.
                None => refusal(limit),
            }
        }
        // Only a cost `check_packable` refuses gets here.
        Err(_) => refusal(limit),
    }
}

/// What the in-process store answers a request it cannot decide, should
/// one get past [`check_packable`]: a denial that keeps the state, never an
/// admission.
fn refusal(limit: &Limit) -> Decision {
    Decision {
        allowed: false,
        limit: limit.burst(),
        remaining: 0,
        retry_after: Duration::MAX,
        reset: Duration::ZERO,
    }
}

#[cfg(test)]
mod tests;
