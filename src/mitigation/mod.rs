//! Mitigations for a hot key: store wrappers that spare the shared store
//! calls it does not need, each turned on per policy and each a [`Store`]
//! itself, so they stack with the rest in `server.rs`.
//!
//! - [`DenyCache`]: once the store has denied a key, answer 429 in the
//!   instance until that denial's `retry_after`, without a call. For a key
//!   that is over its limit (an abusive tenant, a client bug, everyone
//!   behind one address).
//! - [`Leases`]: an instance takes up to N tokens with a request's own
//!   call and spends them locally. For a key that is admitted, and hot.
//! - [`Sharded`]: a key split over S sub-buckets on S slots (so nodes),
//!   each with a share of the limit. For a key whose calls, however few
//!   per request, are more than one node can serve.
//!
//! [`Store`]: crate::store::Store

mod deny_cache;
mod leases;
mod shards;
mod table;
#[cfg(test)]
mod tests;

pub use deny_cache::DenyCache;
pub use leases::{Leases, lease_life, lease_take};
pub use shards::{MAX_SHARDS, Sharded, shard_key, shard_limit};
