//! What every algorithm answers, and what the in-process store keeps.
//!
//! Shared vocabulary: imports nothing of the crate but the clock's unit.

use crate::clock::Micros;
use std::time::Duration;

/// The answer for one request, with everything the HTTP headers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request was admitted (and its cost deducted).
    pub allowed: bool,
    /// The limit's capacity in whole tokens (`RateLimit-Limit`).
    pub limit: u64,
    /// Whole tokens left after this decision, rounded down.
    pub remaining: u64,
    /// How long until another request of the same cost would be admitted:
    /// zero if one would be right now. Exact to the microsecond: a request at
    /// `now + retry_after` is admitted, one a microsecond earlier is not.
    pub retry_after: Duration,
    /// How long until the full limit is available again (zero if it is):
    /// what that means per algorithm is in [`crate::algorithm`].
    pub reset: Duration,
}

/// An algorithm's state in 16 bytes, as the in-process store keeps it: one
/// word of counts and the instant from which the state is the same as no
/// state at all.
///
/// That instant is what lets a store drop idle entries without knowing
/// their limit (`now >= full_at`): for a bucket it is when the bucket is
/// full again, for a window when its counts have all expired. Each
/// algorithm packs and unpacks its own state (`pack`/`unpack` beside its
/// core); the sliding log cannot, its state grows with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    /// Counts, in the algorithm's own layout.
    pub word: u64,
    /// From this instant on, the state equals no state.
    pub full_at: Micros,
}
