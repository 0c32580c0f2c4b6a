//! The atomic store: one EVALSHA of the algorithm's script per check.
//!
//! What differs per algorithm (the script, its key space, how it reads the
//! limit, whether it takes a hand-back ceiling) is asked of the algorithm's
//! description ([`crate::algorithm`]); this store only does the I/O.

use super::call::Call;
use super::{RedisConnection, RedisSettings, redis_key, write_redis_key};
use crate::algorithm::{Algorithm, Decision};
use crate::key::BucketKey;
use crate::store::{BoxFuture, Check, Checked, Source, Store, StoreError};
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, RedisWrite, Script, ServerErrorKind, Value};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// The atomic store. See the module docs.
#[derive(Debug)]
pub struct LuaStore {
    connection: RedisConnection,
    /// One per algorithm, in [`Algorithm::ALL`] order.
    scripts: [Script; 5],
    prefix: String,
    ttl_margin_us: u64,
}

/// Parses a script's reply, `"<allowed> <remaining> <retry_us> <reset_us>"`.
fn parse_reply(reply: &str) -> Option<(bool, u64, u64, u64)> {
    let mut fields = reply.split(' ').map(str::parse::<u64>);
    let allowed = fields.next()?.ok()?;
    let remaining = fields.next()?.ok()?;
    let retry = fields.next()?.ok()?;
    let reset = fields.next()?.ok()?;
    if fields.next().is_some() || allowed > 1 {
        return None;
    }
    Some((allowed == 1, remaining, retry, reset))
}

/// [`parse_reply`] on the reply as redis-rs read it: the script returns a
/// bulk string (RESP2 and 3); any string reply is read the same way.
fn decode_reply(reply: &Value) -> Option<(bool, u64, u64, u64)> {
    match reply {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok().and_then(parse_reply),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => parse_reply(text),
        _ => None,
    }
}

impl LuaStore {
    /// A store on `connection`.
    pub fn new(connection: RedisConnection, settings: &RedisSettings) -> Self {
        Self {
            connection,
            scripts: Algorithm::ALL.map(|a| Script::new(a.script())),
            prefix: settings.prefix.clone(),
            ttl_margin_us: u64::try_from(settings.ttl_margin.as_micros()).unwrap_or(u64::MAX),
        }
    }

    fn script(&self, algorithm: Algorithm) -> &Script {
        // `ALL` lists the variants in declaration order.
        &self.scripts[algorithm as usize]
    }

    /// The SHA1 of `algorithm`'s script, as EVALSHA sends it.
    pub fn script_hash(&self, algorithm: Algorithm) -> &str {
        self.script(algorithm).get_hash()
    }

    /// The Redis key of `key` under `algorithm` with this store's prefix.
    pub fn key_name(&self, algorithm: Algorithm, key: BucketKey) -> String {
        redis_key(&self.prefix, algorithm, key)
    }

    /// The decision for `check`, straight from the script.
    ///
    /// The EVALSHA is written straight into one `Cmd` (keys and numbers
    /// into its one buffer) and the reply read from the bytes redis-rs
    /// parsed: `Script::key(..).arg(..)` built a `Vec` per argument, the
    /// key went through `format!`, and the reply through a `String`, which
    /// together were a quarter of this process's CPU per check
    /// (docs/redis.md). NOSCRIPT (after a restart or SCRIPT FLUSH) loads
    /// the script and sends the command again, as `Script` does.
    pub async fn decide(&self, check: &Check) -> Result<Decision, StoreError> {
        let Check {
            key,
            limit,
            cost,
            now,
            ceiling,
            ..
        } = *check;
        limit.check_cost(cost)?;
        let algorithm = limit.algorithm();
        let script = self.script(algorithm);
        // EVALSHA, sha, numkeys, key, now, cost, up to 3 limit words, TTL
        // margin, ceiling; data: the words' digits and the key.
        let mut command = Cmd::with_capacity(11, 40 + 34 + self.prefix.len() + 8 * 20);
        command.arg("EVALSHA").arg(script.get_hash()).arg(1);
        write_redis_key(
            &mut command.writer_for_next_arg(),
            &self.prefix,
            algorithm,
            key,
        )
        .map_err(RedisError::from)?;
        command.arg(now).arg(cost);
        for word in algorithm.script_args(&limit).as_slice() {
            command.arg(*word);
        }
        command.arg(self.ttl_margin_us);
        if let (Some(ceiling), true) = (ceiling, algorithm.takes_ceiling()) {
            // At most the capacity, so the script's integers stay exact.
            command.arg(ceiling.min(limit.capacity_units()));
        }
        let topology = self.connection.topology();
        let call = Call::start(topology.bucket_node(key), "EVALSHA", algorithm.as_str());
        let mut connection = self.connection.clone();
        let reply = evalsha(&mut connection, &command, script)
            .instrument(call.span())
            .await;
        call.finish(&reply, topology);
        let reply = reply?;
        let (allowed, remaining, retry_after, reset) = decode_reply(&reply).ok_or_else(|| {
            RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "rate limit script reply",
                format!("{reply:?}"),
            ))
        })?;
        Ok(Decision {
            allowed,
            limit: limit.burst(),
            remaining,
            retry_after: Duration::from_micros(retry_after),
            reset: Duration::from_micros(reset),
        })
    }
}

/// Sends `command` (an EVALSHA of `script`); on NOSCRIPT loads the script
/// and sends it again, as redis-rs's `ScriptInvocation` does.
async fn evalsha(
    connection: &mut RedisConnection,
    command: &Cmd,
    script: &Script,
) -> Result<Value, RedisError> {
    match connection
        .req_packed_command(command)
        .await
        .and_then(Value::extract_error)
    {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(connection).await?;
            connection
                .req_packed_command(command)
                .await?
                .extract_error()
        }
        reply => reply,
    }
}

impl Store for LuaStore {
    fn check(&self, check: Check) -> BoxFuture<'_, Result<Checked, StoreError>> {
        Box::pin(async move {
            let decision = self.decide(&check).await?;
            Ok(Checked::decided(decision, check.limit, Source::Redis))
        })
    }

    fn backend(&self) -> &'static str {
        "lua"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.connection.ping())
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        Some(Arc::clone(&self.connection.topology().owner(slot).label))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_replies_parse_strictly() {
        assert_eq!(parse_reply("1 99 0 100000"), Some((true, 99, 0, 100_000)));
        assert_eq!(
            parse_reply("0 0 4503599627370496 1"),
            Some((false, 0, 1 << 52, 1))
        );
        for bad in ["", "1 2 3", "1 2 3 4 5", "2 0 0 0", "1 -1 0 0", "1 2.5 0 0"] {
            assert_eq!(parse_reply(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn replies_decode_from_any_string_value() {
        let fields = Some((false, 3, 250, 9_000));
        assert_eq!(
            decode_reply(&Value::BulkString(b"0 3 250 9000".to_vec())),
            fields
        );
        assert_eq!(
            decode_reply(&Value::SimpleString("0 3 250 9000".into())),
            fields
        );
        assert_eq!(
            decode_reply(&Value::VerbatimString {
                format: redis::VerbatimFormat::Text,
                text: "0 3 250 9000".into()
            }),
            fields
        );
        for bad in [
            Value::BulkString(vec![0xff, b' ', b'1']),
            Value::Int(1),
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
        ] {
            assert_eq!(decode_reply(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn scripts_are_indexed_in_declaration_order() {
        for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
            assert_eq!(algorithm as usize, i, "{algorithm:?}");
        }
    }
}
