//! What one atomic check costs Redis, on the paths a service takes, beside
//! the same token bucket written the straightforward way; and how close our
//! client gets to redis-benchmark running the very same EVALSHA.
//!
//! Two parts, one command:
//! - **Mixes** (our client only: each check passes the wall clock as `now`,
//!   which redis-benchmark cannot vary): `refill`, 10 000 keys at 300/s,
//!   every check admitted after refilling (the correction loops run: 300
//!   does not divide the period); `denied`, 16 drained keys (the read-only
//!   path); `new keys`, a key never seen on every check, which expires about
//!   a second later (keys appearing and expiring); and `mix`, 70/20/10 of
//!   those. `token_bucket.lua` and `gcra.lua` through [`LuaStore`], the
//!   straightforward script ([`STRAIGHTFORWARD_LUA`]) and the empty one
//!   (`return 1`, the floor of any EVALSHA: the same keys and arguments
//!   through the same client, nothing done) run the same checks on an
//!   emptied server in turn, so each script's cost is read against the
//!   floor of the same run.
//! - **Fixed now** (as redis-benchmark needs): 10 000 keys, one `now`, a
//!   bucket so large every check is admitted. No refill, and after a key's
//!   first write `token_bucket.lua` keeps its TTL (the flattering case for
//!   it); the straightforward script sets it every time. redis-benchmark
//!   runs it (and the empty script, the floor of any EVALSHA) and so does
//!   our client, for the throughput comparison.
//!
//! Redis CPU per check comes from `INFO commandstats` (`usec_per_call` of
//! EVALSHA: the script's own time) and from `INFO cpu` (the whole server,
//! networking and active expiry included, per check). Our client keeps
//! `depth` checks in flight on its one pipelined connection
//! (`store::redis::pipe`); redis-benchmark uses one connection with
//! `-P depth`.

use anyhow::{Context, bail};
use ratelimiter::algorithm::{Algorithm, Limit};
use ratelimiter::store::redis::{RedisConnection, RedisSettings};
use ratelimiter::store::{BucketKey, Check, LuaStore};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use testkit::RedisServer;

/// Options of `lua-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct LuaBenchArgs {
    /// Checks per side
    #[arg(long, default_value_t = 200_000)]
    pub checks: u64,
    /// Checks in flight (pipeline depth)
    #[arg(long, default_value_t = 16)]
    pub depth: u64,
    /// Distinct keys
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Pin the redis-server this command starts to this CPU (with taskset);
    /// run the command itself pinned elsewhere (`taskset -c 1 loadtest ...`)
    /// so clients and server do not share a core
    #[arg(long)]
    pub redis_cpu: Option<usize>,
    /// Use this Redis instead of starting a redis-server (it is FLUSHED and its stats reset)
    #[arg(long)]
    pub redis_url: Option<String>,
}

/// Fixed "now" for both sides (redis-benchmark cannot vary an argument).
const NOW: u64 = 1_800_000_000_000_000;

pub(crate) struct Stats {
    pub(crate) calls: u64,
    pub(crate) usec: f64,
}

/// The server's CPU time so far (user + system), seconds.
pub(crate) async fn cpu_seconds(conn: &mut RedisConnection) -> anyhow::Result<f64> {
    let cpu: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    Ok(field(&cpu, "used_cpu_user").context("used_cpu_user")?
        + field(&cpu, "used_cpu_sys").context("used_cpu_sys")?)
}

pub(crate) fn field(info: &str, name: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

pub(crate) async fn stats(conn: &mut RedisConnection) -> anyhow::Result<Stats> {
    let commands: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let line = commands
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .context("no EVALSHA in INFO commandstats")?;
    let get = |key: &str| -> Option<f64> {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    };
    Ok(Stats {
        calls: get("calls").context("calls")? as u64,
        usec: get("usec").context("usec")?,
    })
}

/// One side's result.
#[derive(Debug)]
pub struct Side {
    /// Who ran the checks.
    pub name: &'static str,
    /// Checks per second.
    pub per_second: f64,
    /// Checks denied (`None`: the client does not say, as redis-benchmark).
    pub denied: Option<u64>,
    /// EVALSHA's own time per call, microseconds (commandstats).
    pub script_us: f64,
    /// Whole-server CPU per check, microseconds (INFO cpu delta / calls).
    pub server_cpu_us: f64,
}

/// Connection settings shared by both sides: generous timeouts (this
/// measures cost, not latency) and the same TTL margin.
pub(crate) fn bench_settings(url: &str, prefix: &str) -> RedisSettings {
    RedisSettings {
        prefix: prefix.to_owned(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        ..RedisSettings::new(vec![url.to_owned()], false)
    }
}

/// Resets the server's stats; returns its CPU time so far.
pub(crate) async fn begin(admin: &mut RedisConnection) -> anyhow::Result<f64> {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await?;
    cpu_seconds(admin).await
}

/// One side's figures, from the server's stats since [`begin`].
async fn finish(
    admin: &mut RedisConnection,
    name: &'static str,
    per_second: f64,
    denied: Option<u64>,
    cpu_before: f64,
) -> anyhow::Result<Side> {
    let after = stats(admin).await?;
    let cpu_after = cpu_seconds(admin).await?;
    Ok(Side {
        name,
        per_second,
        denied,
        script_us: after.usec / after.calls as f64,
        server_cpu_us: (cpu_after - cpu_before) * 1e6 / after.calls as f64,
    })
}

fn limit() -> Limit {
    // 10^12 tokens at 1 per microsecond: never empty, every check writes.
    Limit::new(1_000_000_000_000, 1_000_000, Duration::from_secs(1)).expect("valid")
}

async fn ours(url: &str, args: &LuaBenchArgs) -> anyhow::Result<Side> {
    let settings = bench_settings(url, "bench:");
    let mut admin = RedisConnection::connect(&settings).await?;
    let () = redis::cmd("FLUSHALL").query_async(&mut admin).await?;
    let store = Arc::new(LuaStore::new(
        RedisConnection::connect(&settings).await?,
        &settings,
    ));
    let limit = limit();
    // Load the script and warm up before the stats are reset.
    store
        .decide(&Check::new(BucketKey(0), limit, 1, NOW))
        .await?;
    let keys = args.keys;
    let check: CheckFn = Arc::new(move |n| {
        let store = Arc::clone(&store);
        Box::pin(async move {
            let d = store
                .decide(&Check::new(BucketKey(u128::from(n % keys)), limit, 1, NOW))
                .await?;
            if !d.allowed {
                bail!("a check was denied: the bench measures the write path");
            }
            Ok(true)
        })
    });
    let name = "our client (LuaStore, pipelined), token_bucket.lua";
    drive(&mut admin, args, name, check).await
}

/// The same token bucket as `token_bucket.lua` (the same arguments and
/// replies, nothing written on a denial, a key that outlives its refill by
/// the margin), written the straightforward way: a hash read with HMGET and
/// written with HSET and PEXPIRE on every admitted check; doubles with
/// floor and ceil, no exactness corrections, no clock-skew care.
pub(crate) const STRAIGHTFORWARD_LUA: &str = "\
local now = tonumber(ARGV[1]) local cost = tonumber(ARGV[2]) \
local unit = tonumber(ARGV[3]) local rate = tonumber(ARGV[4]) \
local cap = tonumber(ARGV[5]) local margin = tonumber(ARGV[6]) \
local v = redis.call('HMGET', KEYS[1], 'tokens', 'last') \
local tokens = tonumber(v[1]) or cap \
local last = tonumber(v[2]) or now \
if now > last then \
  tokens = math.min(cap, tokens + (now - last) * rate) last = now \
end \
local need = cost * unit local allowed = 0 \
if tokens >= need then tokens = tokens - need allowed = 1 end \
local reset = math.ceil((cap - tokens) / rate) local retry = 0 \
if allowed == 0 then retry = math.ceil((need - tokens) / rate) end \
if allowed == 1 then \
  redis.call('HSET', KEYS[1], 'tokens', tokens, 'last', last) \
  redis.call('PEXPIRE', KEYS[1], math.ceil((reset + margin) / 1000)) \
end \
return string.format('%d %d %d %d', allowed, math.floor(tokens / unit), retry, reset)";

/// The floor: what EVALSHA costs before a script does anything.
const EMPTY_LUA: &str = "return 1";

async fn redis_benchmark(
    url: &str,
    args: &LuaBenchArgs,
    name: &'static str,
    script: &str,
) -> anyhow::Result<Side> {
    let settings = bench_settings(url, "");
    let mut admin = RedisConnection::connect(&settings).await?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query_async(&mut admin)
        .await?;
    let port = url.rsplit(':').next().context("port in the Redis URL")?;
    // Each script starts from an empty keyspace (they store different types).
    let () = redis::cmd("FLUSHALL").query_async(&mut admin).await?;
    let cpu_before = begin(&mut admin).await?;
    let limit = limit();
    let out = std::process::Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", port, "-c", "1", "--csv"])
        .args([
            "-n",
            &args.checks.to_string(),
            "-P",
            &args.depth.to_string(),
        ])
        .args(["-r", &args.keys.to_string()])
        .args([
            "EVALSHA",
            &sha,
            "1",
            "rb:{__rand_int__}",
            &NOW.to_string(),
            "1",
        ])
        .arg(limit.units_per_token().to_string())
        .arg(limit.rate_units_per_us().to_string())
        .arg(limit.capacity_units().to_string())
        .arg(settings.ttl_margin.as_micros().to_string())
        .output()
        .context("cannot run redis-benchmark (Debian: apt-get install redis-tools)")?;
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // --csv: a header line, then "test","rps",...
    let rps: f64 = text
        .lines()
        .filter(|l| l.starts_with("\"EVALSHA"))
        .find_map(|l| l.split(',').nth(1)?.trim_matches('"').parse().ok())
        .with_context(|| format!("no rate in redis-benchmark output: {text}"))?;
    finish(&mut admin, name, rps, None, cpu_before).await
}

/// The checks of a mix, each on one of three paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// 10 000 keys at 300/s, revisited far slower than they refill:
    /// admitted after refilling, with the division corrections.
    Refill,
    /// 16 keys of 10 an hour, drained: denied, the read-only path (exactly
    /// all but the first 10 of each within a run).
    Denied,
    /// A key never seen, 10 at 10/s: written with a TTL, expired by Redis
    /// about a second later.
    NewKey,
}

/// Which path check `n` takes.
type Pick = fn(u64) -> Path;

/// The mixes, by name.
const MIXES: [(&str, Pick); 4] = [
    ("refill", |_| Path::Refill),
    ("denied", |_| Path::Denied),
    ("new keys", |_| Path::NewKey),
    ("mix 70/20/10", |n| match n % 10 {
        0..=6 => Path::Refill,
        7 | 8 => Path::Denied,
        _ => Path::NewKey,
    }),
];

/// Check `n`'s key and limit on `path`.
fn request(path: Path, n: u64, keys: u64) -> (BucketKey, Limit) {
    let limit = |burst, rate| Limit::per_second(burst, rate).expect("valid");
    match path {
        Path::Refill => (BucketKey(u128::from(n % keys)), limit(1000, 300)),
        Path::Denied => (
            BucketKey(1 << 64 | u128::from(n % 16)),
            Limit::new(10, 10, Duration::from_secs(3600)).expect("valid"),
        ),
        Path::NewKey => (BucketKey(2 << 64 | u128::from(n)), limit(10, 10)),
    }
}

fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// One check: whether it was admitted.
type CheckFn = Arc<dyn Fn(u64) -> Checking + Send + Sync>;
type Checking = std::pin::Pin<Box<dyn Future<Output = anyhow::Result<bool>> + Send>>;

/// Runs `checks` checks, `depth` at a time, on an emptied server; returns
/// its figures.
async fn drive(
    admin: &mut RedisConnection,
    args: &LuaBenchArgs,
    name: &'static str,
    check: CheckFn,
) -> anyhow::Result<Side> {
    let cpu_before = begin(admin).await?;
    let (next, denied) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.depth {
        let (check, next, denied, checks) = (
            Arc::clone(&check),
            Arc::clone(&next),
            Arc::clone(&denied),
            args.checks,
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= checks {
                    return anyhow::Ok(());
                }
                if !check(n).await? {
                    denied.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let per_second = args.checks as f64 / started.elapsed().as_secs_f64();
    let denied = denied.load(Ordering::Relaxed);
    finish(admin, name, per_second, Some(denied), cpu_before).await
}

/// One mix's sides: `token_bucket.lua`, `gcra.lua`, the straightforward
/// script and the empty one.
struct MixSides {
    bucket: Side,
    gcra: Side,
    plain: Side,
    floor: Side,
}

/// One mix, through `token_bucket.lua`, `gcra.lua`, the empty script and
/// the straightforward one, in turn.
async fn mix(url: &str, args: &LuaBenchArgs, pick: Pick) -> anyhow::Result<MixSides> {
    let settings = bench_settings(url, "mix:");
    let mut admin = RedisConnection::connect(&settings).await?;
    let connection = RedisConnection::connect(&settings).await?;
    let store = Arc::new(LuaStore::new(connection.clone(), &settings));
    let margin = settings.ttl_margin.as_micros() as u64;
    let bench = Bench {
        args,
        pick,
        keys: args.keys,
        margin,
    };
    let ours = bench
        .lua_store(
            &mut admin,
            &store,
            Algorithm::TokenBucket,
            "token_bucket.lua (LuaStore)",
        )
        .await?;
    let gcra = bench
        .lua_store(&mut admin, &store, Algorithm::Gcra, "gcra.lua (LuaStore)")
        .await?;
    // The floor: the empty script, the same key and arguments.
    let floor = bench
        .script(
            &mut admin,
            &store,
            &connection,
            EMPTY_LUA,
            "empty script (`return 1`)",
        )
        .await?;
    let plain = bench
        .script(
            &mut admin,
            &store,
            &connection,
            STRAIGHTFORWARD_LUA,
            "straightforward script",
        )
        .await?;
    Ok(MixSides {
        bucket: ours,
        gcra,
        plain,
        floor,
    })
}

/// What every side of one mix shares: the checks it picks and their
/// arguments.
struct Bench<'a> {
    args: &'a LuaBenchArgs,
    pick: Pick,
    keys: u64,
    margin: u64,
}

impl Bench<'_> {
    /// One side through [`LuaStore`], the mix's limits under `algorithm`,
    /// on an emptied server with the script loaded first.
    async fn lua_store(
        &self,
        admin: &mut RedisConnection,
        store: &Arc<LuaStore>,
        algorithm: Algorithm,
        name: &'static str,
    ) -> anyhow::Result<Side> {
        let () = redis::cmd("FLUSHALL").query_async(admin).await?;
        // Load the script before the stats are reset.
        let limit = request(Path::Refill, 0, 1).1.with_algorithm(algorithm);
        store
            .decide(&Check::new(BucketKey(u128::MAX), limit, 1, wall_us()))
            .await?;
        let (pick, keys) = (self.pick, self.keys);
        let checks: CheckFn = {
            let store = Arc::clone(store);
            Arc::new(move |n| {
                let store = Arc::clone(&store);
                Box::pin(async move {
                    let (key, limit) = request(pick(n), n, keys);
                    let limit = limit.with_algorithm(algorithm);
                    let d = store.decide(&Check::new(key, limit, 1, wall_us())).await?;
                    Ok(d.allowed)
                })
            })
        };
        drive(admin, self.args, name, checks).await
    }

    /// One side through a script of `code` with the token bucket's key and
    /// arguments, on an emptied server with the script loaded first. A reply
    /// starting with 1 is an admission (the empty script's `1` too).
    async fn script(
        &self,
        admin: &mut RedisConnection,
        store: &Arc<LuaStore>,
        connection: &RedisConnection,
        code: &str,
        name: &'static str,
    ) -> anyhow::Result<Side> {
        let () = redis::cmd("FLUSHALL").query_async(admin).await?;
        let script = Arc::new(redis::Script::new(code));
        let () = script
            .prepare_invoke()
            .load_async(admin)
            .await
            .map(|_: String| ())?;
        let (pick, keys, margin) = (self.pick, self.keys, self.margin);
        let (store, connection) = (Arc::clone(store), connection.clone());
        let checks: CheckFn = Arc::new(move |n| {
            let (store, script, mut connection) =
                (Arc::clone(&store), Arc::clone(&script), connection.clone());
            Box::pin(async move {
                let (key, limit) = request(pick(n), n, keys);
                let reply: String = script
                    .key(store.key_name(Algorithm::TokenBucket, key))
                    .arg(wall_us())
                    .arg(1)
                    .arg(limit.units_per_token())
                    .arg(limit.rate_units_per_us())
                    .arg(limit.capacity_units())
                    .arg(margin)
                    .invoke_async(&mut connection)
                    .await?;
                Ok(reply.starts_with('1'))
            })
        });
        drive(admin, self.args, name, checks).await
    }
}

/// Runs both parts and prints their tables.
pub async fn run(args: LuaBenchArgs) -> anyhow::Result<()> {
    let own;
    let url = match &args.redis_url {
        Some(u) => u.clone(),
        None => {
            own = match args.redis_cpu {
                Some(cpu) => RedisServer::start_pinned(cpu)?,
                None => RedisServer::start()?,
            };
            own.url()
        }
    };
    let mut out = format!(
        "Mixes: {} checks each, {} in flight, `now` from the wall clock; each script on an emptied server:\n\n\
         | mix | script | checks/s | denied | EVALSHA usec/call (commandstats) | server CPU us/check (INFO cpu) |\n|---|---|---|---|---|---|\n",
        args.checks, args.depth
    );
    let mut ratios = String::from(
        "| mix | token_bucket.lua / straightforward: EVALSHA | server CPU | server CPU / the empty script's: token_bucket.lua | gcra.lua |\n|---|---|---|---|---|\n",
    );
    for (name, pick) in MIXES {
        eprintln!("lua-bench: {name} ...");
        let MixSides {
            bucket: ours,
            gcra,
            plain,
            floor,
        } = mix(&url, &args, pick).await?;
        for side in [&ours, &gcra, &plain, &floor] {
            let _ = writeln!(
                out,
                "| {name} | {} | {:.0} | {} | {:.2} | {:.2} |",
                side.name,
                side.per_second,
                side.denied.unwrap_or(0),
                side.script_us,
                side.server_cpu_us
            );
        }
        let _ = writeln!(
            ratios,
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            ours.script_us / plain.script_us,
            ours.server_cpu_us / plain.server_cpu_us,
            ours.server_cpu_us / floor.server_cpu_us,
            gcra.server_cpu_us / floor.server_cpu_us,
        );
    }
    out.push('\n');
    out.push_str(&ratios);

    eprintln!("lua-bench: fixed now ...");
    let floor = redis_benchmark(
        &url,
        &args,
        "redis-benchmark, empty script (`return 1`)",
        EMPTY_LUA,
    )
    .await?;
    let plain = redis_benchmark(
        &url,
        &args,
        "redis-benchmark, straightforward script",
        STRAIGHTFORWARD_LUA,
    )
    .await?;
    let benchmark = redis_benchmark(
        &url,
        &args,
        "redis-benchmark, token_bucket.lua",
        Algorithm::TokenBucket.script(),
    )
    .await?;
    let ours = ours(&url, &args).await?;
    let _ = write!(
        out,
        "\nFixed now: {} checks on {} keys, {} in flight, one `now`, every check admitted (no refill; token_bucket.lua keeps the TTL after a key's first write):\n\n\
         | client | checks/s | EVALSHA usec/call (commandstats) | server CPU us/check (INFO cpu) |\n|---|---|---|---|\n",
        args.checks, args.keys, args.depth
    );
    for side in [&floor, &plain, &benchmark, &ours] {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.2} | {:.2} |",
            side.name, side.per_second, side.script_us, side.server_cpu_us
        );
    }
    let _ = writeln!(
        out,
        "\nour client / redis-benchmark throughput: {:.2}",
        ours.per_second / benchmark.per_second
    );
    println!("{out}");
    Ok(())
}
