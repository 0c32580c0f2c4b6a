//! The atomic store: one EVALSHA of the algorithm's script per check.
//!
//! What differs per algorithm (the script, its key space, how it reads the
//! limit, whether it takes a hand-back ceiling) is asked of the algorithm's
//! description ([`crate::algorithm`]); this store only does the I/O.

use super::call::Call;
use super::resp::{
    Command, bulk_string, end_bulk, write_array_len, write_bulk, write_bulk_len, write_number,
};
use super::{
    RedisConnection, RedisSettings, Reply, Topology, hash_tag, redis_key, write_redis_key,
};
use crate::algorithm::{Algorithm, Decision};
use crate::key::BucketKey;
use crate::store::{
    BoxFuture, Check, CheckFuture, CheckResult, Checked, Source, Store, StoreError,
};
use redis::{Cmd, RedisError, RedisWrite, Script, Value};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// The atomic store. See the module docs.
#[derive(Debug)]
pub struct LuaStore {
    connection: RedisConnection,
    /// One per algorithm, in [`Algorithm::ALL`] order.
    scripts: [Script; 5],
    /// Per algorithm, what every check's EVALSHA holds before the bucket's
    /// hash tag (see [`Evalsha`]).
    heads: [Vec<u8>; 5],
    prefix: String,
    ttl_margin_us: u64,
}

/// A script's reply: allowed, remaining, retry and reset (microseconds),
/// and the tokens taken beyond the cost (0 when no take was asked).
type Fields = (bool, u64, u64, u64, u64);

/// Parses a script's reply, `"<allowed> <remaining> <retry_us> <reset_us>"`
/// and, for a check that takes beyond its cost, `" <extra>"`: four or five
/// unsigned decimal numbers, one space apart, read from the bytes as they
/// came (no UTF-8 pass, no `str` splitting: this runs once per check).
fn parse_reply(reply: &[u8]) -> Option<Fields> {
    let mut fields = [0u64; 5];
    let mut parts = reply.split(|&b| b == b' ');
    for (i, field) in fields.iter_mut().enumerate() {
        let Some(digits) = parts.next() else {
            // The fifth is optional.
            if i == 4 {
                break;
            }
            return None;
        };
        if digits.is_empty() || digits.len() > 20 {
            return None;
        }
        let mut n: u64 = 0;
        for &digit in digits {
            if !digit.is_ascii_digit() {
                return None;
            }
            n = n.checked_mul(10)?.checked_add(u64::from(digit - b'0'))?;
        }
        *field = n;
    }
    let [allowed, remaining, retry, reset, extra] = fields;
    if parts.next().is_some() || allowed > 1 {
        return None;
    }
    Some((allowed == 1, remaining, retry, reset, extra))
}

/// [`parse_reply`] on the reply as redis-rs read it: the script returns a
/// bulk string (RESP2 and 3); any string reply is read the same way.
fn decode_reply(reply: &Value) -> Option<Fields> {
    match reply {
        Value::BulkString(bytes) => parse_reply(bytes),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => {
            parse_reply(text.as_bytes())
        }
        _ => None,
    }
}

/// [`parse_reply`] on a reply however it came: a frame of our own
/// connection is read in place when it is the bulk string the script
/// returns, and decoded to a `Value` otherwise.
fn read_reply(reply: Reply) -> Result<Fields, RedisError> {
    if let Reply::Frame(frame) = &reply
        && let Some(fields) = bulk_string(frame).and_then(parse_reply)
    {
        return Ok(fields);
    }
    let value = reply.into_value()?;
    decode_reply(&value).ok_or_else(|| unexpected(format!("{value:?}")))
}

fn unexpected(shown: String) -> RedisError {
    RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "rate limit script reply",
        shown,
    ))
}

impl LuaStore {
    /// A store on `connection`.
    pub fn new(connection: RedisConnection, settings: &RedisSettings) -> Self {
        let scripts = Algorithm::ALL.map(|a| Script::new(a.script()));
        let heads = Algorithm::ALL
            .map(|a| Evalsha::head(scripts[a as usize].get_hash(), &settings.prefix, a));
        Self {
            connection,
            scripts,
            heads,
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
    /// parsed: `Script::key(..).arg(..)` would build a `Vec` per argument,
    /// the key would go through `format!` and the reply through a
    /// `String`, a large share of this process's CPU per check
    /// (docs/performance.md, "Client side of a Redis check"). NOSCRIPT
    /// (after a restart or SCRIPT FLUSH) loads the script and sends the
    /// command again, as `Script` does.
    pub async fn decide(&self, check: &Check) -> Result<Decision, StoreError> {
        Ok(self.decide_taking(check).await?.0)
    }

    /// [`LuaStore::decide`] with the check's take beyond its cost
    /// ([`Check::take`]): the decision and the extra tokens granted, in
    /// the same script run.
    pub async fn decide_taking(&self, check: &Check) -> Result<(Decision, u64), StoreError> {
        let Check {
            key,
            limit,
            cost,
            now,
            ceiling,
            take,
            ..
        } = *check;
        limit.check_cost(cost)?;
        let algorithm = limit.algorithm();
        let script = self.script(algorithm);
        let mut numbers = [0; 9];
        let mut len = 0;
        let words = algorithm.script_args(&limit);
        // Only a token bucket leases.
        let take = take.filter(|_| algorithm == Algorithm::TokenBucket);
        let ceiling = ceiling
            .filter(|_| algorithm.takes_ceiling())
            // The take's arguments follow the ceiling's place.
            .or(take.map(|_| u64::MAX))
            // At most the capacity, so the script's integers stay exact.
            .map(|ceiling| ceiling.min(limit.capacity_units()));
        let take = take.map(|t| [t.extra, t.leave]);
        for number in [now, cost]
            .iter()
            .chain(words.as_slice())
            .chain([self.ttl_margin_us].iter())
            .chain(ceiling.as_ref())
            .chain(take.iter().flatten())
        {
            numbers[len] = *number;
            len += 1;
        }
        let command = Evalsha {
            head: &self.heads[algorithm as usize],
            sha: script.get_hash(),
            prefix: &self.prefix,
            algorithm,
            key,
            numbers: &numbers[..len],
        };
        let topology = self.connection.topology();
        let call = Call::start(topology.bucket_node(key), "EVALSHA", algorithm.as_str());
        // On NOSCRIPT the script is loaded where it was missing, and sent again.
        let reply = self
            .connection
            .call_script(&command, script)
            .instrument(call.span())
            .await;
        call.finish(&reply, topology);
        let (allowed, remaining, retry_after, reset, extra) = read_reply(reply?)?;
        let decision = Decision {
            allowed,
            limit: limit.burst(),
            remaining,
            retry_after: Duration::from_micros(retry_after),
            reset: Duration::from_micros(reset),
        };
        Ok((decision, extra))
    }
}

/// One check's EVALSHA: the script's SHA1, one key, then the numbers (now,
/// cost, the limit's words, the TTL margin, the ceiling if the algorithm
/// takes one, a lease's take). It writes itself as RESP straight into our connection's
/// buffer: no `Cmd` with its two allocations, then copied, and everything
/// before the bucket's hash tag (the name, the SHA1, the key count, the
/// key's length, prefix and tag) copied from a `head` made once per
/// algorithm.
struct Evalsha<'a> {
    /// [`Evalsha::head`] of this script, prefix and algorithm.
    head: &'a [u8],
    sha: &'a str,
    prefix: &'a str,
    algorithm: Algorithm,
    key: BucketKey,
    numbers: &'a [u64],
}

impl Evalsha<'_> {
    /// The RESP of an EVALSHA of `sha` on a key of `algorithm` under
    /// `prefix`, up to the key's hash tag.
    fn head(sha: &str, prefix: &str, algorithm: Algorithm) -> Vec<u8> {
        let mut head = Vec::new();
        write_bulk(&mut head, b"EVALSHA");
        write_bulk(&mut head, sha.as_bytes());
        write_bulk(&mut head, b"1");
        write_bulk_len(&mut head, prefix.len() + algorithm.key_tag().len() + 34);
        head.extend_from_slice(prefix.as_bytes());
        head.extend_from_slice(algorithm.key_tag().as_bytes());
        head
    }
}

impl Command for Evalsha<'_> {
    fn write_resp(&self, out: &mut Vec<u8>) {
        // The numbers: at most 20 digits and 6 bytes of framing each.
        out.reserve(4 + self.head.len() + 36 + 26 * self.numbers.len());
        write_array_len(out, 4 + self.numbers.len());
        out.extend_from_slice(self.head);
        out.extend_from_slice(&hash_tag(self.key));
        end_bulk(out);
        for &number in self.numbers {
            write_number(out, number);
        }
    }

    fn slot(&self) -> Option<u16> {
        // The key's hash tag is the bucket's hex.
        Some(self.key.slot())
    }

    fn cmd(&self) -> Cow<'_, Cmd> {
        let mut command = Cmd::with_capacity(4 + self.numbers.len(), 160 + self.prefix.len());
        command.arg("EVALSHA").arg(self.sha).arg(1);
        // Writing into a command's buffer cannot fail.
        let _ = write_redis_key(
            &mut command.writer_for_next_arg(),
            self.prefix,
            self.algorithm,
            self.key,
        );
        for &number in self.numbers {
            command.arg(number);
        }
        Cow::Owned(command)
    }
}

impl LuaStore {
    /// A check's answer, for [`Store::check`] and [`Store::check_owned`].
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would hold `check` twice (see src/middleware/front.rs)"
    )]
    fn checked(&self, check: Check) -> impl Future<Output = CheckResult> + Send + '_ {
        async move {
            let (decision, extra) = self.decide_taking(&check).await?;
            Ok(Checked {
                extra,
                ..Checked::decided(decision, check.limit, Source::Redis)
            })
        }
    }
}

impl Store for LuaStore {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        CheckFuture::waiting(self.checked(check))
    }

    /// The same future owning the store: under the deadline, one box a
    /// check instead of two.
    fn check_owned(self: Arc<Self>, check: Check) -> CheckFuture<'static> {
        CheckFuture::waiting(async move { self.checked(check).await })
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

    fn one_node(&self) -> bool {
        matches!(self.connection.topology(), Topology::Standalone(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_replies_parse_strictly() {
        assert_eq!(
            parse_reply(b"1 99 0 100000"),
            Some((true, 99, 0, 100_000, 0))
        );
        assert_eq!(
            parse_reply(b"0 0 4503599627370496 1"),
            Some((false, 0, 1 << 52, 1, 0))
        );
        assert_eq!(
            parse_reply(b"0 18446744073709551615 0 0"),
            Some((false, u64::MAX, 0, 0, 0))
        );
        assert_eq!(
            parse_reply(b"0 9999999999999999999 0 0"),
            Some((false, 9_999_999_999_999_999_999, 0, 0, 0))
        );
        assert_eq!(
            parse_reply(b"1 30 0 700000 9"),
            Some((true, 30, 0, 700_000, 9))
        );
        for bad in [
            &b""[..],
            b"1 2 3",
            b"1 2 3 4 5 6",
            b"1 2 3 4 ",
            b"1 2 3 4 -5",
            b"2 0 0 0",
            b"1 -1 0 0",
            b"1 2.5 0 0",
            b"1 +2 0 0",
            b"1  2 0 0",
            b"1 2 0 0 ",
            b"0 18446744073709551616 0 0",
            b"0 99999999999999999999 0 0",
            b"0 000000000000000000001 0 0",
            b"1 \xff 0 0",
        ] {
            assert_eq!(parse_reply(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn replies_decode_from_any_string_value() {
        let fields = Some((false, 3, 250, 9_000, 0));
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
    fn an_evalsha_writes_itself_as_the_redis_crate_would() {
        let sha = "a".repeat(40);
        for (prefix, numbers) in [
            (
                "rl:",
                &[1_800_000_000_000_000, 1, 10, 1_000, 100_000, 1_000_000, 7][..],
            ),
            ("", &[0, u64::MAX][..]),
        ] {
            for algorithm in Algorithm::ALL {
                let head = Evalsha::head(&sha, prefix, algorithm);
                let command = Evalsha {
                    head: &head,
                    sha: &sha,
                    prefix,
                    algorithm,
                    key: BucketKey(u128::MAX / 3),
                    numbers,
                };
                let mut written = Vec::new();
                command.write_resp(&mut written);
                assert_eq!(written, command.cmd().get_packed_command(), "{algorithm:?}");
            }
        }
    }

    #[test]
    fn scripts_are_indexed_in_declaration_order() {
        for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
            assert_eq!(algorithm as usize, i, "{algorithm:?}");
        }
    }
}
