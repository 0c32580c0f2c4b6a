//! What one atomic check costs Redis, and how close our client gets to
//! redis-benchmark running the very same EVALSHA on the same server.
//!
//! Both sides run the token-bucket script on 10 000 keys with a bucket so
//! large that every check is admitted: the write path (GET, arithmetic,
//! SET ... PX), the expensive one. Redis CPU per check comes from
//! `INFO commandstats` (`usec_per_call` of EVALSHA: the script's own time)
//! and from `INFO cpu` (the whole server, networking included, per check).
//! Throughput is checks per second at the same concurrency: our client keeps
//! `depth` checks in flight on one multiplexed connection (redis-rs pipelines
//! them); redis-benchmark uses one connection with `-P depth`.

use anyhow::{Context, bail};
use ratelimiter::algorithm::{Algorithm, Limit};
use ratelimiter::store::redis::{RedisConnection, RedisSettings};
use ratelimiter::store::{BucketKey, Check, LuaStore};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
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
    /// EVALSHA's own time per call, microseconds (commandstats).
    pub script_us: f64,
    /// Whole-server CPU per check, microseconds (INFO cpu delta / calls).
    pub server_cpu_us: f64,
}

/// Connection settings shared by both sides: generous timeouts (this
/// measures cost, not latency) and the same TTL margin.
pub(crate) fn bench_settings(url: &str, prefix: &str) -> RedisSettings {
    RedisSettings {
        urls: vec![url.to_owned()],
        cluster: false,
        prefix: prefix.to_owned(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        retries: 1,
        ttl_margin: Duration::from_secs(1),
        topology_refresh: Duration::from_secs(1),
        tls: Default::default(),
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
    cpu_before: f64,
) -> anyhow::Result<Side> {
    let after = stats(admin).await?;
    let cpu_after = cpu_seconds(admin).await?;
    Ok(Side {
        name,
        per_second,
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
    let cpu_before = begin(&mut admin).await?;
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.depth {
        let (store, next, checks, keys) = (
            Arc::clone(&store),
            Arc::clone(&next),
            args.checks,
            args.keys,
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= checks {
                    return anyhow::Ok(());
                }
                let d = store
                    .decide(&Check::new(BucketKey(u128::from(n % keys)), limit, 1, NOW))
                    .await?;
                if !d.allowed {
                    bail!("a check was denied: the bench measures the write path");
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let per_second = args.checks as f64 / started.elapsed().as_secs_f64();
    let name = "our client (LuaStore, redis-rs multiplexed), token_bucket.lua";
    finish(&mut admin, name, per_second, cpu_before).await
}

/// The "straightforward" script the issue measured as a baseline: a hash
/// with HMGET, HSET and PEXPIRE (no arithmetic, so a lower bound for it).
const HASH_BASELINE_LUA: &str = "local v = redis.call('HMGET', KEYS[1], 't', 'l') \
    local t = tonumber(v[1]) or tonumber(ARGV[5]) \
    redis.call('HSET', KEYS[1], 't', t - 1, 'l', ARGV[1]) \
    redis.call('PEXPIRE', KEYS[1], 2000) return 1";

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
    finish(&mut admin, name, rps, cpu_before).await
}

/// Runs both sides and prints a table.
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
    let floor = redis_benchmark(
        &url,
        &args,
        "redis-benchmark, empty script (`return 1`)",
        EMPTY_LUA,
    )
    .await?;
    let hash = redis_benchmark(
        &url,
        &args,
        "redis-benchmark, HMGET/HSET/PEXPIRE script (no arithmetic)",
        HASH_BASELINE_LUA,
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
    let mut out = format!(
        "Lua token bucket, {} checks on {} keys, {} in flight, every check admitted (write path):\n\n\
         | client | checks/s | EVALSHA usec/call (commandstats) | server CPU us/check (INFO cpu) |\n|---|---|---|---|\n",
        args.checks, args.keys, args.depth
    );
    for side in [&floor, &hash, &benchmark, &ours] {
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
