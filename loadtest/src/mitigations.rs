//! `mitigations`: what the hot-key mitigations save and what they cost in
//! accuracy, measured on real Redis through the service's own store stack
//! (`server::build_stack`: sharding, deny cache, leases, failure policy,
//! deadline, the Lua script), without HTTP in the way.
//!
//! **Accuracy and calls** (one redis-server, three stacks as three
//! instances, each with its own leases and deny cache). One hot key of
//! burst `B` refilled at `R` per second gets Poisson arrivals at a fraction
//! of `R` for `--seconds`, each sent to a random instance at its moment, so
//! checks overlap as they do in a fleet. Every request is recorded with the
//! instant it was decided at. Then one exact bucket (the Rust core) is fed
//! the same requests at the same instants, in order:
//!
//! - *under-admission*: how many fewer the fleet admitted than the exact
//!   bucket;
//! - *false denials*: requests the fleet refused that the exact bucket
//!   admitted. The row without a mitigation is this measurement's floor:
//!   the very same one bucket, in Redis, decides checks in the order they
//!   reach it, which can differ by microseconds from the order of their
//!   instants, and near empty that moves a token from one request to the
//!   next (the admitted totals still agree);
//! - *over-admission*: admissions the exact bucket refuses when fed only
//!   what the fleet admitted (must be 0);
//! - *Redis calls per admitted request*: EVALSHA calls the server served
//!   (`INFO commandstats`) over the fleet's admissions.
//!
//! **Throughput cap** (a 3-master cluster, each master capped to
//! `--node-cpus` of a core by a cgroup, as `cpus:` in compose). One key is
//! checked flat out by `--concurrency` tasks for `--cap-seconds`, under a
//! limit it never reaches (every check is the script's write path), with
//! 1 and with `--shards` sub-buckets, interleaved, `--repeats` times: the
//! key's checks per second, the hottest node's share of the calls, and
//! each node's CPU.

use crate::results::{self, Table};
use anyhow::Context;
use clap::Args;
use rand::Rng;
use ratelimiter::algorithm::{self, Limit, State};
use ratelimiter::clock::{Clock, SystemClock};
use ratelimiter::config::Config;
use ratelimiter::server::build_stack;
use ratelimiter::store::{BucketKey, Check, FailureMode, Store};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};
use testkit::{RedisCluster, RedisServer};

/// Options of `mitigations`.
#[derive(Debug, Clone, Args)]
pub struct MitigationsArgs {
    /// The hot key's burst
    #[arg(long, default_value_t = 100)]
    pub burst: u64,
    /// The hot key's refill, tokens per second
    #[arg(long, default_value_t = 100)]
    pub rate: u64,
    /// Offered load, as fractions of the refill rate
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.9,1.5,3")]
    pub loads: Vec<f64>,
    /// Seconds per accuracy run
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// CPU of each cluster master in the throughput runs, cores
    #[arg(long, default_value_t = 0.1)]
    pub node_cpus: f64,
    /// The period of that cap, microseconds (the stacks': 20 000)
    #[arg(long, default_value_t = 20_000)]
    pub node_cpu_period_us: u64,
    /// Let the capped masters move between CPUs (the stacks keep each on
    /// one: master i on CPU i mod the CPUs there are)
    #[arg(long)]
    pub wander: bool,
    /// Checks in flight in the throughput runs. Deep enough that a capped
    /// node, not the client, sets the pace: each node's connection is one
    /// pipeline, and a node's cost per call falls as its batches deepen, so
    /// too few in flight, split over the shards, starves each node's batches
    /// (docs/hot-keys.md)
    #[arg(long, default_value_t = 192)]
    pub concurrency: usize,
    /// Seconds per throughput run
    #[arg(long, default_value_t = 6.0)]
    pub cap_seconds: f64,
    /// Sub-buckets in the sharded runs
    #[arg(long, default_value_t = 3)]
    pub shards: u16,
    /// Repeats of every run (figures are min / median / max)
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the throughput-cap runs (they need root for the cgroups)
    #[arg(long)]
    pub no_cap: bool,
    /// Where the results go [default: results/mitigations-<UTC time>]
    #[arg(long)]
    pub results: Option<PathBuf>,
}

/// A mitigation setting, as a policy would turn it on.
#[derive(Debug, Clone, Copy)]
struct Variant {
    name: &'static str,
    deny_cache: bool,
    lease: u64,
    shards: u16,
}

const VARIANTS: [Variant; 6] = [
    Variant {
        name: "none",
        deny_cache: false,
        lease: 0,
        shards: 1,
    },
    Variant {
        name: "deny_cache",
        deny_cache: true,
        lease: 0,
        shards: 1,
    },
    Variant {
        name: "lease = 5",
        deny_cache: false,
        lease: 5,
        shards: 1,
    },
    Variant {
        name: "lease = 20",
        deny_cache: false,
        lease: 20,
        shards: 1,
    },
    Variant {
        name: "lease = 20, deny_cache",
        deny_cache: true,
        lease: 20,
        shards: 1,
    },
    Variant {
        name: "shards = 3",
        deny_cache: false,
        lease: 0,
        shards: 3,
    },
];

/// The service's config for the measured stacks: closed on failure (an
/// error is counted, never hidden by a local share) with a deadline no
/// check here should meet, three instances for the leases' bound.
fn config(redis: &str) -> anyhow::Result<Config> {
    let text = format!(
        r#"
        backend = "lua"
        key_secret = "mitigations-measurement"
        [redis]
        {redis}
        response_timeout = "5s"
        [failure]
        mode = "closed"
        instances = 3
        deadline = "5s"
        "#
    );
    Config::from_toml(&text).context("the measurement's config")
}

pub async fn run(args: MitigationsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.repeats >= 1 && args.concurrency >= 1,
        "--repeats and --concurrency must be at least 1"
    );
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!(
            "mitigations-{}",
            results::timestamp(SystemTime::now())
        ))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut summary = format!(
        "# Hot-key mitigations, measured\n\n`cargo run --release -p loadtest -- mitigations` \
         (burst {}, {} per second; {} repeats).\n\n",
        args.burst, args.rate, args.repeats
    );
    let table = accuracy(&args).await?;
    table.write(&dir, "accuracy")?;
    summary += &format!(
        "## Accuracy and Redis calls\n\nOne hot key, three instances on one redis-server, \
         Poisson arrivals for {} s per run; median (min-max) over the repeats.\n\n{}\n\n",
        args.seconds,
        table.markdown()
    );
    println!("{}", table.markdown());
    if !args.no_cap {
        let (table, ratios) = throughput(&args).await?;
        table.write(&dir, "throughput")?;
        summary += &format!(
            "## Throughput cap\n\nOne key flat out ({} checks in flight, {} s per run) on a \
             3-master cluster, each master capped to {} of a core in periods of {} us, {}; \
             median (min-max) over the repeats.\n\n{}\n\nThe sharded key's checks per \
             second over the unsharded key's, within each repeat (min / median / max): \
             {ratios}.\n",
            args.concurrency,
            args.cap_seconds,
            args.node_cpus,
            args.node_cpu_period_us,
            if args.wander {
                "free to move between CPUs"
            } else {
                "each on one CPU"
            },
            table.markdown()
        );
        println!(
            "\n{}\nsharded / unsharded within each repeat: {ratios}",
            table.markdown()
        );
    }
    std::fs::write(dir.join("summary.md"), &summary)?;
    println!("\nresults in {}", dir.display());
    Ok(())
}

/// `median (min-max)` of `values`, formatted by `f`.
fn spread(values: &mut [f64], f: impl Fn(f64) -> String) -> String {
    values.sort_by(f64::total_cmp);
    match values {
        [] => "-".into(),
        [one] => f(*one),
        _ => format!(
            "{} ({}-{})",
            f(values[values.len() / 2]),
            f(values[0]),
            f(values[values.len() - 1])
        ),
    }
}

/// EVALSHA calls a server served, and their time, µs (commandstats).
fn evalsha(server: &RedisServer) -> anyhow::Result<(u64, f64)> {
    let stats = server.cli(&["info", "commandstats"])?;
    let Some(fields) = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
    else {
        return Ok((0, 0.0));
    };
    let field = |name: &str| -> f64 {
        fields
            .split(',')
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Ok((
        (field("calls") - field("failed_calls")) as u64,
        field("usec"),
    ))
}

/// A server's CPU time so far, seconds (user + system).
fn cpu_seconds(server: &RedisServer) -> anyhow::Result<f64> {
    let info = server.cli(&["info", "cpu"])?;
    let field = |name: &str| -> anyhow::Result<f64> {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("INFO cpu has no {name}"))
    };
    Ok(field("used_cpu_user")? + field("used_cpu_sys")?)
}

/// One accuracy run's counts.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    requests: u64,
    admitted: u64,
    exact: u64,
    false_denials: u64,
    over: u64,
    calls: u64,
    errors: u64,
}

async fn accuracy(args: &MitigationsArgs) -> anyhow::Result<Table> {
    let redis = RedisServer::start()?;
    let config = config(&format!("url = {:?}", redis.url()))?;
    let limit = Limit::per_second(args.burst, args.rate)?;
    let mut table = Table::new(&[
        "offered",
        "mitigation",
        "requests",
        "admitted",
        "exact bucket admits",
        "under-admission",
        "false denials",
        "over-admission",
        "Redis calls per request",
        "per admitted request",
    ]);
    for &load in &args.loads {
        for variant in VARIANTS {
            let mut runs = Vec::new();
            for _ in 0..args.repeats {
                runs.push(accuracy_run(args, &config, &redis, limit, load, variant).await?);
            }
            let col = |f: fn(&Counts) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
            let whole = |v: f64| format!("{v:.0}");
            table.row(vec![
                format!("{:.0} %", load * 100.0),
                variant.name.into(),
                spread(&mut col(|c| c.requests as f64), whole),
                spread(&mut col(|c| c.admitted as f64), whole),
                spread(&mut col(|c| c.exact as f64), whole),
                spread(&mut col(|c| c.exact as f64 - c.admitted as f64), whole),
                spread(&mut col(|c| c.false_denials as f64), whole),
                spread(&mut col(|c| c.over as f64), whole),
                spread(
                    &mut col(|c| c.calls as f64 / c.requests.max(1) as f64),
                    |v| format!("{v:.2}"),
                ),
                spread(
                    &mut col(|c| c.calls as f64 / c.admitted.max(1) as f64),
                    |v| format!("{v:.2}"),
                ),
            ]);
            let errors: u64 = runs.iter().map(|c| c.errors).sum();
            anyhow::ensure!(errors == 0, "{errors} checks failed ({})", variant.name);
            eprintln!("{:.0} % {}: {:?}", load * 100.0, variant.name, runs);
        }
    }
    Ok(table)
}

async fn accuracy_run(
    args: &MitigationsArgs,
    config: &Config,
    redis: &RedisServer,
    limit: Limit,
    load: f64,
    variant: Variant,
) -> anyhow::Result<Counts> {
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(build_stack(config).await?.store);
    }
    // A fresh key per run: a full bucket, nothing held or cached.
    let key = BucketKey(rand::rng().random());
    let clock = SystemClock;
    // Poisson arrivals at `load` x the rate, each to a random instance.
    let per_second = load * args.rate as f64;
    let mut arrivals = Vec::new();
    let mut at = 0.0;
    let mut rng = rand::rng();
    loop {
        at += -(1.0 - rng.random::<f64>()).ln() / per_second;
        if at >= args.seconds {
            break;
        }
        arrivals.push((
            Duration::from_secs_f64(at),
            rng.random_range(0..fleet.len()),
        ));
    }
    let (calls_before, _) = evalsha(redis)?;
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (offset, instance) in arrivals {
        tokio::time::sleep_until(start + offset).await;
        let store: Arc<dyn Store> = Arc::clone(&fleet[instance]);
        tasks.push(tokio::spawn(async move {
            let now = clock.now();
            let check = Check::new(key, limit, 1, now)
                .on_failure(FailureMode::Closed)
                .with_deny_cache(variant.deny_cache)
                .with_lease(variant.lease)
                .with_shards(variant.shards);
            let admitted = store
                .check(check)
                .await
                .ok()
                .and_then(|c| c.decision)
                .map(|d| d.allowed);
            (now, admitted)
        }));
    }
    let mut decided = Vec::with_capacity(tasks.len());
    for task in tasks {
        decided.push(task.await?);
    }
    let (calls_after, _) = evalsha(redis)?;
    decided.sort_by_key(|&(now, _)| now);
    let mut counts = Counts {
        requests: decided.len() as u64,
        calls: calls_after - calls_before,
        ..Counts::default()
    };
    let mut all: Option<State> = None;
    let mut only_admitted: Option<State> = None;
    for &(now, admitted) in &decided {
        let (exact, state) = algorithm::check(&limit, all.take(), 1, now)?;
        all = state;
        counts.exact += u64::from(exact.allowed);
        match admitted {
            None => counts.errors += 1,
            Some(true) => {
                counts.admitted += 1;
                let (d, state) = algorithm::check(&limit, only_admitted.take(), 1, now)?;
                only_admitted = state;
                counts.over += u64::from(!d.allowed);
            }
            Some(false) => counts.false_denials += u64::from(exact.allowed),
        }
    }
    Ok(counts)
}

/// One throughput run's figures.
#[derive(Debug, Clone)]
struct Cap {
    per_second: f64,
    hot_share: f64,
    node_cpu: Vec<f64>,
    p99_ms: f64,
    errors: u64,
}

/// The throughput table, and the sharded key's checks per second over the
/// unsharded key's within each repeat (min / median / max).
async fn throughput(args: &MitigationsArgs) -> anyhow::Result<(Table, String)> {
    let mut cluster = RedisCluster::start()?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    for (i, node) in cluster.nodes.iter_mut().enumerate() {
        if args.wander {
            node.limit_cpu_with_period(args.node_cpus, args.node_cpu_period_us)
        } else {
            node.limit_cpu_pinned(args.node_cpus, args.node_cpu_period_us, i % cpus)
        }
        .context("capping a cluster node's CPU (needs root and cgroup v1 cpu)")?;
    }
    let seeds: Vec<String> = cluster.urls().iter().map(|u| format!("{u:?}")).collect();
    let config = config(&format!("cluster = [{}]", seeds.join(", ")))?;
    // Never reached: every check is the script's write path.
    let limit = Limit::per_second(1_000_000_000, 1_000_000_000)?;
    let mut runs: Vec<(u16, Cap)> = Vec::new();
    for _ in 0..args.repeats {
        for shards in [1, args.shards] {
            let cap = throughput_run(args, &config, &cluster, limit, shards).await?;
            eprintln!("shards {shards}: {cap:?}");
            anyhow::ensure!(cap.errors == 0, "{} checks failed", cap.errors);
            runs.push((shards, cap));
        }
    }
    let mut table = Table::new(&[
        "sub-buckets",
        "hot key checks/s",
        "hottest node's share of calls",
        "CPU per node, busiest first, cores (each capped at the quota)",
        "check p99, ms",
    ]);
    for shards in [1, args.shards] {
        let of: Vec<&Cap> = runs
            .iter()
            .filter(|(s, _)| *s == shards)
            .map(|(_, c)| c)
            .collect();
        let col = |f: fn(&Cap) -> f64| of.iter().map(|c| f(c)).collect::<Vec<f64>>();
        // Busiest first in each run: an unsharded key's node differs by run.
        let busiest_first: Vec<Vec<f64>> = of
            .iter()
            .map(|c| {
                let mut cpu = c.node_cpu.clone();
                cpu.sort_by(|a, b| b.total_cmp(a));
                cpu
            })
            .collect();
        let median_cpu: Vec<String> = (0..3)
            .map(|i| {
                let mut v: Vec<f64> = busiest_first.iter().map(|c| c[i]).collect();
                v.sort_by(f64::total_cmp);
                format!("{:.3}", v[v.len() / 2])
            })
            .collect();
        table.row(vec![
            shards.to_string(),
            spread(&mut col(|c| c.per_second), |v| format!("{v:.0}")),
            spread(&mut col(|c| c.hot_share * 100.0), |v| format!("{v:.0} %")),
            median_cpu.join(" / "),
            spread(&mut col(|c| c.p99_ms), |v| format!("{v:.1}")),
        ]);
    }
    // Each repeat runs unsharded then sharded: their ratio within it.
    let mut ratios: Vec<f64> = runs
        .chunks(2)
        .map(|pair| pair[1].1.per_second / pair[0].1.per_second)
        .collect();
    ratios.sort_by(f64::total_cmp);
    Ok((
        table,
        format!(
            "{:.2} / {:.2} / {:.2}",
            ratios[0],
            ratios[ratios.len() / 2],
            ratios[ratios.len() - 1]
        ),
    ))
}

async fn throughput_run(
    args: &MitigationsArgs,
    config: &Config,
    cluster: &RedisCluster,
    limit: Limit,
    shards: u16,
) -> anyhow::Result<Cap> {
    let store = build_stack(config).await?.store;
    let key = BucketKey(rand::rng().random());
    let check = move |now| {
        Check::new(key, limit, 1, now)
            .on_failure(FailureMode::Closed)
            .with_shards(shards)
    };
    // Warm up: connections, scripts loaded on every node, slot map read.
    for _ in 0..u32::from(shards) * 4 {
        store.check(check(SystemClock.now())).await?;
    }
    let before: Vec<(u64, f64)> = cluster
        .nodes
        .iter()
        .map(|n| Ok((evalsha(n)?.0, cpu_seconds(n)?)))
        .collect::<anyhow::Result<_>>()?;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
            tokio::spawn(async move {
                let (mut latencies, mut errors) = (Vec::new(), 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    match store.check(check(SystemClock.now())).await {
                        Ok(_) => latencies.push(t.elapsed().as_micros() as u64),
                        Err(_) => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(args.cap_seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut latencies, mut errors) = (Vec::new(), 0);
    for task in tasks {
        let (l, e) = task.await?;
        latencies.extend(l);
        errors += e;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut calls = Vec::new();
    let mut node_cpu = Vec::new();
    for (node, (calls_before, cpu_before)) in cluster.nodes.iter().zip(before) {
        calls.push(evalsha(node)?.0 - calls_before);
        node_cpu.push((cpu_seconds(node)? - cpu_before) / seconds);
    }
    let total: u64 = calls.iter().sum();
    latencies.sort_unstable();
    let p99 = latencies
        .get(latencies.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or(0);
    Ok(Cap {
        per_second: latencies.len() as f64 / seconds,
        hot_share: *calls.iter().max().unwrap_or(&0) as f64 / total.max(1) as f64,
        node_cpu,
        p99_ms: p99 as f64 / 1000.0,
        errors,
    })
}
