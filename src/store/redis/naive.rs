//! The racy baseline: GET, decide in Rust, SET (see [`super`]). It keeps
//! token buckets only: it exists to measure the race, not to offer
//! algorithms.
//!
//! It stores the same value the token bucket script does (three
//! little-endian doubles: tokens in units, the instant they were computed
//! for, and when the key expires) under the same key.

use super::call::Call;
use super::{RedisConnection, RedisSettings, Topology, redis_key};
use crate::algorithm::token_bucket::{self, BucketState, TakeUpTo};
use crate::algorithm::{Algorithm, Decision, Limit};
use crate::clock::Micros;
use crate::key::BucketKey;
use crate::store::{BoxFuture, Check, CheckFuture, Checked, Source, Store, StoreError};
use redis::RedisError;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// The stored value: tokens, last and the key's expiry (microseconds), as
/// three little-endian doubles (what the Lua script's
/// `struct.pack('<d<d<d', ...)` writes). Exact: all are integers of at most
/// 2^53.
pub fn encode_state(state: BucketState, expires: Micros) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&(state.tokens as f64).to_le_bytes());
    out[8..16].copy_from_slice(&(state.last as f64).to_le_bytes());
    out[16..].copy_from_slice(&(expires as f64).to_le_bytes());
    out
}

/// The bucket state in a value written by [`encode_state`] (or the
/// script); `None` for a value of another shape.
pub fn decode_state(bytes: &[u8]) -> Option<BucketState> {
    let tokens = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let last = f64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    if bytes.len() != 24 || !(tokens >= 0.0 && last >= 0.0) {
        return None;
    }
    Some(BucketState {
        tokens: tokens as u64,
        last: last as u64,
    })
}

/// The TTL for a bucket full again in `reset`: rounded up to whole
/// milliseconds, plus the margin (as the script computes it).
fn ttl_ms(reset: Duration, margin: Duration) -> u64 {
    u64::try_from((reset + margin).as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// The racy baseline. See the module docs.
#[derive(Debug)]
pub struct NaiveStore {
    connection: RedisConnection,
    prefix: String,
    ttl_margin: Duration,
}

impl NaiveStore {
    /// A store on `connection`.
    pub fn new(connection: RedisConnection, settings: &RedisSettings) -> Self {
        Self {
            connection,
            prefix: settings.prefix.clone(),
            ttl_margin: settings.ttl_margin,
        }
    }

    fn key_name(&self, key: BucketKey) -> String {
        redis_key(&self.prefix, Algorithm::TokenBucket, key)
    }

    /// One command, observed (see `call.rs`).
    async fn run<T: redis::FromRedisValue>(
        &self,
        command: redis::Cmd,
        name: &str,
        operation: &'static str,
        label: &'static str,
    ) -> Result<T, RedisError> {
        let mut connection = self.connection.clone();
        let call = Call::start(
            self.connection.topology().node(name.as_bytes()),
            operation,
            label,
        );
        let result = command
            .query_async(&mut connection)
            .instrument(call.span())
            .await;
        call.finish(&result, self.connection.topology());
        result
    }

    /// Step 1 of 2: read the bucket (`None`: absent, i.e. full).
    pub async fn read(&self, key: BucketKey) -> Result<Option<BucketState>, StoreError> {
        let name = self.key_name(key);
        let mut get = redis::cmd("GET");
        get.arg(&name);
        let raw: Option<Vec<u8>> = self.run(get, &name, "GET", "naive_get").await?;
        Ok(raw.as_deref().and_then(decode_state))
    }

    /// Step 2 of 2: decide on what was read and write the result back,
    /// unconditionally: whatever another instance wrote since step 1 is lost.
    /// Returns the decision and the tokens taken beyond the cost.
    pub async fn decide_and_write(
        &self,
        check: &Check,
        read: Option<BucketState>,
    ) -> Result<(Decision, u64), StoreError> {
        let Check {
            key,
            limit,
            cost,
            now,
            ceiling,
            take,
            ..
        } = *check;
        Self::keeps(&limit)?;
        let (decision, state, extra) = token_bucket::check_up_to(
            &limit,
            read,
            cost,
            now,
            ceiling.unwrap_or(u64::MAX),
            take.unwrap_or(TakeUpTo::NONE),
        )?;
        if decision.allowed {
            let name = self.key_name(key);
            if decision.reset.is_zero() {
                let mut del = redis::cmd("DEL");
                del.arg(&name);
                let () = self.run(del, &name, "DEL", "naive_del").await?;
            } else {
                let ttl = ttl_ms(decision.reset, self.ttl_margin);
                let mut set = redis::cmd("SET");
                set.arg(&name)
                    .arg(&encode_state(state, now + ttl * 1000)[..])
                    .arg("PX")
                    .arg(ttl);
                let () = self.run(set, &name, "SET", "naive_set").await?;
            }
        }
        Ok((decision, extra))
    }

    /// Refuses anything this store does not keep.
    fn keeps(limit: &Limit) -> Result<(), StoreError> {
        let algorithm = limit.algorithm();
        if algorithm.has_naive_store() {
            Ok(())
        } else {
            Err(StoreError::UnsupportedAlgorithm {
                backend: "naive",
                algorithm: algorithm.as_str(),
            })
        }
    }
}

impl Store for NaiveStore {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        CheckFuture::waiting(async move {
            Self::keeps(&check.limit)?;
            let read = self.read(check.key).await?;
            let (decision, extra) = self.decide_and_write(&check, read).await?;
            Ok(Checked {
                extra,
                ..Checked::decided(decision, check.limit, Source::Redis)
            })
        })
    }

    fn backend(&self) -> &'static str {
        "naive"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.connection.ping())
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        Some(Arc::clone(&self.connection.topology().owner(slot).label))
    }

    fn one_node(&self) -> bool {
        matches!(self.connection.topology(), Topology::Standalone(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_encoding_round_trips_exactly_at_the_limits() {
        for state in [
            BucketState { tokens: 0, last: 0 },
            BucketState {
                tokens: crate::algorithm::MAX_EXACT,
                last: 1 << 53,
            },
            BucketState {
                tokens: 123_456_789,
                last: 1_800_000_000_123_457,
            },
        ] {
            assert_eq!(decode_state(&encode_state(state, 1 << 53)), Some(state));
        }
        assert_eq!(decode_state(b"short"), None);
        assert_eq!(decode_state(&[0xff; 24]), None, "NaN is not a state");
        assert_eq!(decode_state(&[0; 16]), None);
    }

    #[test]
    fn ttl_rounds_up_and_adds_the_margin() {
        assert_eq!(
            ttl_ms(Duration::from_micros(1), Duration::from_millis(1000)),
            1001
        );
        assert_eq!(ttl_ms(Duration::from_micros(3000), Duration::ZERO), 3);
    }
}
