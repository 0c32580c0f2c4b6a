//! The algorithm argument, in numbers: `cargo run -p loadtest -- compare`.
//!
//! Every algorithm gets the same policy (burst `B` at `R`/s; the window
//! algorithms read it as `B` per `W = B / R` seconds) and is driven through
//! its real Lua script on a real redis-server. Time is simulated: `now` is
//! an argument of every check, so traffic shapes are exact to the
//! microsecond and every run gives the same decisions.
//!
//! 1. Accuracy, per traffic shape (one key, requests in time order):
//!    - `boundary`: 2B requests in the last 100 ms before a window boundary
//!      and 2B in the first 100 ms after it;
//!    - `idle-burst`: 3B at one instant after idling, then 2R for 2W;
//!    - `steady`: 3R, evenly, for 5W;
//!    - `poisson`: Poisson arrivals at 1.5R for 10W, plus bursts of B/2 at
//!      Poisson instants (2 per W), seeded.
//!
//!    Reported: admitted; the most admitted in any interval of length `W`
//!    against `B` (the over-admission ratio: the exact log's is at most 1);
//!    the most admitted in any interval `t` beyond the bucket's promise
//!    `B + R·t`; and, request by request against the exact sliding log fed
//!    the same traffic, false denials (log admitted, algorithm refused) and
//!    extra admissions (the reverse).
//! 2. Memory: `MEMORY USAGE` of one key after a window of traffic at
//!    0.5R, R, 2R and 10R; and summed over the N keys of the cost run.
//! 3. Cost: N keys each sent 1.5B requests over one window, 16 checks in
//!    flight: checks/s, EVALSHA's own time per call (`INFO commandstats`)
//!    and the server's CPU per check (`INFO cpu`).

use crate::luabench::{begin, bench_settings, cpu_seconds, stats};
use ratelimiter::algorithm::{Algorithm, Limit};
use ratelimiter::store::redis::RedisConnection;
use ratelimiter::store::{BucketKey, Check, LuaStore};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::RedisServer;

/// The compare command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// The policy's burst B (the window algorithms' limit per window)
    #[arg(long, default_value_t = 100)]
    pub burst: u64,
    /// The policy's rate R, per second (W = B / R seconds)
    #[arg(long, default_value_t = 10)]
    pub rate: u64,
    /// Keys for the total-memory and cost runs
    #[arg(long, default_value_t = 1000)]
    pub keys: u64,
    /// Seed of the Poisson shape
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Use this Redis instead of starting a redis-server (it is FLUSHED)
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Also write the tables as CSV files with this prefix
    /// (`<prefix>-accuracy.csv`, `-memory.csv`, `-cost.csv`)
    #[arg(long)]
    pub csv: Option<String>,
}

/// Epoch-aligned start, well past any boundary arithmetic edge.
const T0: u64 = 1_800_000_000_000_000;

/// A small, seeded generator (xorshift64*): the shapes must be reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // (0, 1]
        ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
    /// An exponential gap with mean `mean_us`.
    fn gap(&mut self, mean_us: f64) -> u64 {
        (-self.next().ln() * mean_us) as u64
    }
}

/// Request times (cost 1 each), ascending.
fn shape(name: &str, b: u64, r: u64, w: u64, seed: u64) -> Vec<u64> {
    // Start on a window boundary plus one window, so "before the boundary"
    // is inside a window everyone agrees on.
    let start = (T0 / w + 1) * w;
    let even = |from: u64, n: u64, span: u64| -> Vec<u64> {
        (0..n).map(|i| from + i * span / n.max(1)).collect()
    };
    let mut times = match name {
        "boundary" => {
            let edge = start + w;
            let mut t = even(edge - 100_000, 2 * b, 100_000);
            t.extend(even(edge, 2 * b, 100_000));
            t
        }
        "idle-burst" => {
            let at = start + 2 * w + w / 3;
            let mut t = vec![at; (3 * b) as usize];
            t.extend(even(at + 1, 2 * r * 2 * w / 1_000_000, 2 * w));
            t
        }
        "steady" => even(start, 3 * r * 5 * w / 1_000_000, 5 * w),
        "poisson" => {
            let mut rng = Rng(seed.max(1));
            let end = start + 10 * w;
            let mut t = Vec::new();
            let mut now = start;
            let mean = 1_000_000.0 / (1.5 * r as f64);
            loop {
                now += rng.gap(mean);
                if now >= end {
                    break;
                }
                t.push(now);
            }
            let mut now = start;
            loop {
                now += rng.gap(w as f64 / 2.0);
                if now >= end {
                    break;
                }
                t.extend(std::iter::repeat_n(now, (b / 2) as usize));
            }
            t
        }
        other => unreachable!("shape {other}"),
    };
    times.sort_unstable();
    times
}

const SHAPES: [&str; 4] = ["boundary", "idle-burst", "steady", "poisson"];

/// One algorithm on one shape.
#[derive(Debug, Clone)]
struct Accuracy {
    shape: &'static str,
    algorithm: Algorithm,
    requests: usize,
    admitted: usize,
    worst_in_window: usize,
    excess_over_bucket: f64,
    false_denials: usize,
    extra_admissions: usize,
}

/// Runs `times` through `algorithm` on a fresh key; returns who was admitted.
async fn drive(
    store: &LuaStore,
    limit: Limit,
    key: BucketKey,
    times: &[u64],
) -> anyhow::Result<Vec<bool>> {
    let mut admitted = Vec::with_capacity(times.len());
    for &t in times {
        admitted.push(store.decide(&Check::new(key, limit, 1, t)).await?.allowed);
    }
    Ok(admitted)
}

/// Most admitted within any `(t - w, t]`.
fn worst_in_window(admitted_at: &[u64], w: u64) -> usize {
    let mut worst = 0;
    let mut lo = 0;
    for (hi, &t) in admitted_at.iter().enumerate() {
        while admitted_at[lo] + w <= t {
            lo += 1;
        }
        worst = worst.max(hi - lo + 1);
    }
    worst
}

/// The most admitted in any interval `[a, b]` beyond `burst + rate·(b - a)`.
fn excess_over_bucket(admitted_at: &[u64], burst: u64, rate: u64) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for i in 0..admitted_at.len() {
        for j in i..admitted_at.len() {
            let span = (admitted_at[j] - admitted_at[i]) as f64 / 1e6;
            let excess = (j - i + 1) as f64 - burst as f64 - rate as f64 * span;
            worst = worst.max(excess);
        }
    }
    worst.max(0.0)
}

/// The policy, enforced by `algorithm`.
fn policy(args: &CompareArgs, algorithm: Algorithm) -> anyhow::Result<Limit> {
    Ok(Limit::per_second(args.burst, args.rate)?.with_algorithm(algorithm))
}

async fn accuracy(store: &LuaStore, args: &CompareArgs) -> anyhow::Result<Vec<Accuracy>> {
    let w = policy(args, Algorithm::SlidingLog)?.window().window_us;
    let mut out = Vec::new();
    let mut key = 0u128;
    for shape_name in SHAPES {
        let times = shape(shape_name, args.burst, args.rate, w, args.seed);
        key += 1;
        let reference = drive(
            store,
            policy(args, Algorithm::SlidingLog)?,
            BucketKey(key << 8),
            &times,
        )
        .await?;
        for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
            let admitted = drive(
                store,
                policy(args, algorithm)?,
                BucketKey((key << 8) + 1 + i as u128),
                &times,
            )
            .await?;
            let at: Vec<u64> = times
                .iter()
                .zip(&admitted)
                .filter(|(_, a)| **a)
                .map(|(t, _)| *t)
                .collect();
            out.push(Accuracy {
                shape: shape_name,
                algorithm,
                requests: times.len(),
                admitted: at.len(),
                worst_in_window: worst_in_window(&at, w),
                excess_over_bucket: excess_over_bucket(&at, args.burst, args.rate),
                false_denials: reference
                    .iter()
                    .zip(&admitted)
                    .filter(|(r, a)| **r && !**a)
                    .count(),
                extra_admissions: reference
                    .iter()
                    .zip(&admitted)
                    .filter(|(r, a)| !**r && **a)
                    .count(),
            });
        }
    }
    Ok(out)
}

/// `MEMORY USAGE` of one key after one window at each rate multiple.
const RATES: [f64; 4] = [0.5, 1.0, 2.0, 10.0];

async fn memory_usage(conn: &mut RedisConnection, name: &str) -> anyhow::Result<Option<u64>> {
    Ok(redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(name)
        .arg("SAMPLES")
        .arg(0)
        .query_async(conn)
        .await?)
}

/// `MEMORY USAGE` summed over every key (SCAN): what the keys themselves
/// hold, without the allocator and client-buffer noise of `used_memory`.
async fn total_memory_usage(conn: &mut RedisConnection) -> anyhow::Result<(u64, u64)> {
    let mut cursor: u64 = 0;
    let (mut keys, mut bytes) = (0u64, 0u64);
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        for name in batch {
            if let Some(b) = memory_usage(conn, &name).await? {
                keys += 1;
                bytes += b;
            }
        }
        if next == 0 {
            return Ok((keys, bytes));
        }
        cursor = next;
    }
}

#[derive(Debug, Clone)]
struct Memory {
    algorithm: Algorithm,
    /// Bytes of one key at each of [`RATES`] (`None`: no key held).
    per_key: Vec<Option<u64>>,
}

async fn memory(
    store: &LuaStore,
    admin: &mut RedisConnection,
    args: &CompareArgs,
) -> anyhow::Result<Vec<Memory>> {
    let mut out = Vec::new();
    for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        let limit = policy(args, algorithm)?;
        let w = limit.window().window_us;
        let mut per_key = Vec::new();
        for (j, multiple) in RATES.iter().enumerate() {
            let key = BucketKey(0xAB00 + (i * 16 + j) as u128);
            let n = ((args.rate as f64 * multiple) * w as f64 / 1e6).round() as u64;
            let start = (T0 / w + 1) * w;
            let times: Vec<u64> = (0..n).map(|k| start + k * w / n.max(1)).collect();
            drive(store, limit, key, &times).await?;
            per_key.push(memory_usage(admin, &store.key_name(algorithm, key)).await?);
        }
        out.push(Memory { algorithm, per_key });
    }
    Ok(out)
}

#[derive(Debug, Clone)]
struct Cost {
    algorithm: Algorithm,
    checks: u64,
    per_second: f64,
    script_us: f64,
    server_cpu_us: f64,
    /// Keys held at the end (a full token bucket holds none).
    keys: u64,
    bytes_per_key: f64,
}

/// N keys, each sent 1.5B requests evenly over one window, 16 in flight
/// (each task owns whole keys, so every key sees its requests in order).
async fn cost(
    store: &Arc<LuaStore>,
    admin: &mut RedisConnection,
    args: &CompareArgs,
) -> anyhow::Result<Vec<Cost>> {
    const DEPTH: u64 = 16;
    let mut out = Vec::new();
    for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        let () = redis::cmd("FLUSHALL").query_async(admin).await?;
        let limit = policy(args, algorithm)?;
        let w = limit.window().window_us;
        let per_key = args.burst * 3 / 2;
        let start = (T0 / w + 1) * w;
        let cpu_before = begin(admin).await?;
        let started = Instant::now();
        let mut tasks = Vec::new();
        for task in 0..DEPTH {
            let (store, keys) = (Arc::clone(store), args.keys);
            tasks.push(tokio::spawn(async move {
                // Round-robin over this task's keys, time advancing per round:
                // the keys are all active at once, as in production.
                let mine: Vec<u64> = (task..keys).step_by(DEPTH as usize).collect();
                for k in 0..per_key {
                    let now = start + k * w / per_key;
                    for &key in &mine {
                        let key = BucketKey(((i as u128) << 64) | u128::from(key));
                        store.decide(&Check::new(key, limit, 1, now)).await?;
                    }
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let s = stats(admin).await?;
        let cpu_after = cpu_seconds(admin).await?;
        let (keys, bytes) = total_memory_usage(admin).await?;
        out.push(Cost {
            algorithm,
            checks: s.calls,
            per_second: s.calls as f64 / elapsed,
            script_us: s.usec / s.calls as f64,
            server_cpu_us: (cpu_after - cpu_before) * 1e6 / s.calls as f64,
            keys,
            bytes_per_key: bytes as f64 / keys.max(1) as f64,
        });
    }
    Ok(out)
}

/// Runs all three parts, prints the tables (and writes CSVs).
pub async fn run(args: CompareArgs) -> anyhow::Result<String> {
    let own;
    let url = match &args.redis_url {
        Some(u) => u.clone(),
        None => {
            own = RedisServer::start()?;
            own.url()
        }
    };
    let settings = bench_settings(&url, "cmp:");
    let mut admin = RedisConnection::connect(&settings).await?;
    let () = redis::cmd("FLUSHALL").query_async(&mut admin).await?;
    let store = Arc::new(LuaStore::new(
        RedisConnection::connect(&settings).await?,
        &settings,
    ));
    let acc = accuracy(&store, &args).await?;
    let mem = memory(&store, &mut admin, &args).await?;
    let costs = cost(&store, &mut admin, &args).await?;
    let report = markdown(&args, &acc, &mem, &costs)?;
    print!("{report}");
    if let Some(prefix) = &args.csv {
        write_csvs(prefix, &acc, &mem, &costs)?;
    }
    Ok(report)
}

fn markdown(
    args: &CompareArgs,
    acc: &[Accuracy],
    mem: &[Memory],
    costs: &[Cost],
) -> anyhow::Result<String> {
    let w = policy(args, Algorithm::SlidingLog)?.window().window_us;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Policy: burst {} at {}/s; windows of {} per {} s.\n",
        args.burst,
        args.rate,
        args.burst,
        Duration::from_micros(w).as_secs_f64()
    );
    out.push_str("| shape | algorithm | requests | admitted | most in any window | / limit | most beyond burst + rate·t | false denials vs log | extra admissions vs log |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for a in acc {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {} |",
            a.shape,
            a.algorithm.as_str(),
            a.requests,
            a.admitted,
            a.worst_in_window,
            a.worst_in_window as f64 / args.burst as f64,
            a.excess_over_bucket,
            a.false_denials,
            a.extra_admissions
        );
    }
    out.push_str("\n| algorithm |");
    for m in RATES {
        let _ = write!(out, " bytes/key at {m}R |");
    }
    out.push_str(" keys held / bytes per key, N keys after 1.5R |\n|---|");
    for _ in RATES {
        out.push_str("---:|");
    }
    out.push_str("---:|\n");
    for (m, c) in mem.iter().zip(costs) {
        let _ = write!(out, "| {} |", m.algorithm.as_str());
        for b in &m.per_key {
            match b {
                Some(b) => {
                    let _ = write!(out, " {b} |");
                }
                None => out.push_str(" (no key) |"),
            }
        }
        let _ = writeln!(out, " {} / {:.0} |", c.keys, c.bytes_per_key);
    }
    let _ = writeln!(
        out,
        "\n{} keys x {} checks each, 16 in flight:\n",
        args.keys,
        args.burst * 3 / 2
    );
    out.push_str("| algorithm | checks | checks/s | EVALSHA us/call | server CPU us/check |\n|---|---:|---:|---:|---:|\n");
    for c in costs {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.2} | {:.2} |",
            c.algorithm.as_str(),
            c.checks,
            c.per_second,
            c.script_us,
            c.server_cpu_us
        );
    }
    Ok(out)
}

fn write_csvs(
    prefix: &str,
    acc: &[Accuracy],
    mem: &[Memory],
    costs: &[Cost],
) -> anyhow::Result<()> {
    let mut a = String::from(
        "shape,algorithm,requests,admitted,worst_in_window,excess_over_bucket,false_denials,extra_admissions\n",
    );
    for r in acc {
        let _ = writeln!(
            a,
            "{},{},{},{},{},{:.3},{},{}",
            r.shape,
            r.algorithm.as_str(),
            r.requests,
            r.admitted,
            r.worst_in_window,
            r.excess_over_bucket,
            r.false_denials,
            r.extra_admissions
        );
    }
    std::fs::write(format!("{prefix}-accuracy.csv"), a)?;
    let mut m = String::from("algorithm,rate_multiple,bytes\n");
    for r in mem {
        for (multiple, b) in RATES.iter().zip(&r.per_key) {
            let _ = writeln!(
                m,
                "{},{multiple},{}",
                r.algorithm.as_str(),
                b.map_or_else(String::new, |b| b.to_string())
            );
        }
    }
    std::fs::write(format!("{prefix}-memory.csv"), m)?;
    let mut c = String::from(
        "algorithm,checks,checks_per_second,evalsha_us,server_cpu_us,keys,bytes_per_key\n",
    );
    for r in costs {
        let _ = writeln!(
            c,
            "{},{},{:.0},{:.3},{:.3},{},{:.1}",
            r.algorithm.as_str(),
            r.checks,
            r.per_second,
            r.script_us,
            r.server_cpu_us,
            r.keys,
            r.bytes_per_key
        );
    }
    std::fs::write(format!("{prefix}-cost.csv"), c)?;
    Ok(())
}
