//! A Redis Cluster's own faults under load, measured:
//! `cargo run -p loadtest -- cluster-faults`.
//!
//! Each scenario starts a cluster of three masters with a replica each, two
//! API instances on it (`--redis-cluster`, failure mode `local`), and drives
//! many API keys at a steady rate from clients round-robin over the
//! instances. Then, under that load:
//!
//! - `kill`: SIGKILL one master; its replica is promoted (the cluster's own
//!   failover, `--cluster-node-timeout` after the kill);
//! - `reshard`: move every slot that holds one of the first master's keys
//!   to the second master, one after the other, as `redis-cli --cluster
//!   reshard` does (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE): the keys
//!   see ASK and MOVED redirects;
//! - `flush`: `SCRIPT FLUSH` on every node: every check's EVALSHA meets
//!   NOSCRIPT once per node.
//!
//! What it reports, from the responses alone (`RateLimit-Limit` equal to
//! the burst is the shared bucket, equal to the local share the fallback),
//! for the keys the fault touches (the dead master's, the moved slots',
//! every key for a flush) apart from the others: 5xx and transport errors,
//! answers decided by the local share and from when to when, and admitted
//! requests beside what one exact token bucket per key admits for the same
//! requests at the same instants (a key handed a fresh burst shows there).
//! And which nodes the instances' `/readyz` named degraded meanwhile
//! (polled every 25 ms): the dead master, and no other.

use anyhow::{Context, bail, ensure};
use ratelimiter::algorithm::{Limit, token_bucket};
use ratelimiter::config::Config;
use ratelimiter::identity::{Identity, KeyHasher};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use testkit::{RedisCluster, TempDir};

/// The cluster-faults command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Faults, in order: kill, reshard, flush
    #[arg(long, value_delimiter = ',', default_value = "kill,reshard,flush")]
    pub faults: Vec<String>,
    /// API keys driven (spread over the three masters by their slots)
    #[arg(long, default_value_t = 48)]
    pub keys: usize,
    /// Each key's burst
    #[arg(long, default_value_t = 20)]
    pub burst: u64,
    /// Each key's rate, tokens per second
    #[arg(long, default_value_t = 5)]
    pub rate: u64,
    /// Concurrent clients
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Total requests per second the clients aim at
    #[arg(long, default_value_t = 600)]
    pub qps: u64,
    /// Seconds of traffic before the fault
    #[arg(long, default_value_t = 2.0)]
    pub before: f64,
    /// Seconds of traffic after the fault is done (the replica promoted,
    /// the slots moved, the scripts flushed)
    #[arg(long, default_value_t = 4.0)]
    pub after: f64,
    /// The nodes' `cluster-node-timeout`, ms (how long before a dead
    /// master's replica takes over)
    #[arg(long, default_value_t = 2000)]
    pub node_timeout_ms: u64,
    /// Run the nodes with `cluster-require-full-coverage yes` (Redis's
    /// default): while a dead master's slots have no owner, every node
    /// refuses every key (CLUSTERDOWN), so the healthy masters' keys fall
    /// back too. The stack runs with `no`.
    #[arg(long)]
    pub full_coverage: bool,
    /// The instances' `--failure-deadline`
    #[arg(long, default_value = "10ms")]
    pub deadline: String,
    /// Also write the table as CSV to this file
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Reshard,
    Flush,
}

impl Fault {
    fn parse(text: &str) -> anyhow::Result<Self> {
        Ok(match text {
            "kill" => Fault::Kill,
            "reshard" => Fault::Reshard,
            "flush" => Fault::Flush,
            other => bail!("unknown fault {other:?} (kill, reshard, flush)"),
        })
    }

    fn as_str(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Reshard => "reshard",
            Fault::Flush => "flush",
        }
    }
}

/// Who answered one request, as read from the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Redis,
    Local,
    Error,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Since the start of the run.
    sent: Duration,
    key: usize,
    admitted: bool,
    source: Source,
}

/// Figures for one set of keys (touched by the fault, or not).
#[derive(Debug, Clone, Default)]
pub struct KeyFigures {
    /// How many keys.
    pub keys: usize,
    /// Requests sent for them.
    pub requests: usize,
    /// Transport errors and 5xx.
    pub errors: usize,
    /// Answers decided by the local share.
    pub local: usize,
    /// From the fault's start to the last local answer, ms (0: none).
    pub local_until_ms: f64,
    /// Admitted over the run.
    pub admitted: usize,
    /// What one exact bucket per key admits for the same requests.
    pub ideal: usize,
    /// The largest excess of admitted over ideal of any one key.
    pub worst_key_excess: i64,
}

/// One scenario's figures.
#[derive(Debug, Clone)]
pub struct ClusterResult {
    /// The fault.
    pub fault: String,
    /// The node the fault took away (the killed master), if any.
    pub fault_node: Option<String>,
    /// Every node an instance's `/readyz` named degraded from the fault
    /// to the end, in order.
    pub degraded: Vec<String>,
    /// How long the fault took, ms (the kill to the replica serving, the
    /// first slot's move to the last's, the flush).
    pub fault_ms: f64,
    /// The keys the fault touches.
    pub touched: KeyFigures,
    /// The others.
    pub untouched: KeyFigures,
}

fn config_text(args: &ClusterArgs) -> String {
    let mut text = format!(
        "key_secret = \"cluster-faults-shared-secret\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {}\nrate = {}\n",
        args.burst, args.rate
    );
    for k in 0..args.keys {
        let _ = write!(
            text,
            "[[api_keys]]\nid = \"tenant-{k}\"\nkey = \"cluster-key-{k}\"\n"
        );
    }
    text
}

/// Steady load over every key ([`crate::outage::steady`]): keys and
/// instances taken in turn, until `stop` is set; who answered read from
/// `RateLimit-Limit` (the burst: Redis; half of it: the local share).
async fn drive(
    urls: Arc<Vec<String>>,
    args: &ClusterArgs,
    start: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<Vec<Sample>> {
    let keys = args.keys;
    let answers = crate::outage::steady(
        args.clients,
        args.qps,
        start,
        Arc::new(move || stop.load(Ordering::Relaxed)),
        Arc::new(move |http, n| {
            http.get(&urls[(n / keys) % urls.len()])
                .header("x-api-key", format!("cluster-key-{}", n % keys))
        }),
    )
    .await?;
    let (burst, share_burst) = (args.burst, (args.burst / 2).max(1));
    Ok(answers
        .into_iter()
        .map(|a| {
            let source = match (a.status, a.limit) {
                (Some(200 | 429), Some(l)) if l == burst => Source::Redis,
                (Some(200 | 429), Some(l)) if l == share_burst => Source::Local,
                _ => Source::Error,
            };
            Sample {
                sent: a.sent,
                key: a.n % keys,
                admitted: a.status == Some(200),
                source,
            }
        })
        .collect())
}

/// The slot of each key's bucket, as the instances compute it.
fn key_slots(config: &Config, keys: usize) -> anyhow::Result<Vec<u16>> {
    let secret = config.key_secret.context("the config sets key_secret")?;
    let hasher = KeyHasher::new(secret);
    Ok((0..keys)
        .map(|k| {
            hasher
                .bucket_key("api", &Identity::ApiKey(format!("tenant-{k}").into()))
                .slot()
        })
        .collect())
}

/// The nodes each instance's `/readyz` names degraded, polled until
/// `stop`; each node once, in the order first named.
async fn watch_readiness(
    urls: Vec<String>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<String> {
    let http = reqwest::Client::new();
    let mut named: Vec<String> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        for url in &urls {
            let Ok(response) = http.get(format!("{url}/readyz")).send().await else {
                continue;
            };
            let Ok(body) = response.json::<serde_json::Value>().await else {
                continue;
            };
            for node in body["degraded_nodes"].as_array().into_iter().flatten() {
                if let Some(node) = node["node"].as_str()
                    && !named.iter().any(|n| n == node)
                {
                    named.push(node.to_owned());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    named
}

/// Injects `fault` into `cluster`; returns the keys it touches and how
/// long it took.
fn inject(
    fault: Fault,
    cluster: &mut RedisCluster,
    slots: &[u16],
) -> anyhow::Result<(Vec<bool>, Duration)> {
    let started = Instant::now();
    let owners = slots
        .iter()
        .map(|&s| cluster.owner(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(match fault {
        Fault::Kill => {
            let took = cluster.kill_master(0)?;
            (owners.iter().map(|&o| o == 0).collect(), took)
        }
        Fault::Reshard => {
            let mut moving: Vec<u16> = slots
                .iter()
                .zip(&owners)
                .filter(|&(_, &o)| o == 0)
                .map(|(&s, _)| s)
                .collect();
            moving.sort_unstable();
            moving.dedup();
            for &slot in &moving {
                cluster.move_slot(slot, 1)?;
            }
            (
                slots.iter().map(|s| moving.contains(s)).collect(),
                started.elapsed(),
            )
        }
        Fault::Flush => {
            for node in &cluster.nodes {
                node.cli(&["script", "flush"])?;
            }
            (vec![true; slots.len()], started.elapsed())
        }
    })
}

fn figures(
    samples: &[Sample],
    ideal: &[bool],
    touched: &[bool],
    want: bool,
    fault_at: Duration,
) -> KeyFigures {
    let mut f = KeyFigures {
        keys: touched.iter().filter(|&&t| t == want).count(),
        ..KeyFigures::default()
    };
    let mut excess = vec![0i64; touched.len()];
    for (s, &ideal) in samples.iter().zip(ideal) {
        if touched[s.key] != want {
            continue;
        }
        f.requests += 1;
        match s.source {
            Source::Error => f.errors += 1,
            Source::Local => {
                f.local += 1;
                f.local_until_ms = f
                    .local_until_ms
                    .max(s.sent.saturating_sub(fault_at).as_secs_f64() * 1000.0);
            }
            Source::Redis => {}
        }
        f.admitted += usize::from(s.admitted);
        f.ideal += usize::from(ideal);
        excess[s.key] += i64::from(s.admitted) - i64::from(ideal);
    }
    f.worst_key_excess = excess
        .iter()
        .zip(touched)
        .filter(|&(_, &t)| t == want)
        .map(|(&e, _)| e)
        .max()
        .unwrap_or(0);
    f
}

async fn scenario(
    fault: Fault,
    args: &ClusterArgs,
    run_id: usize,
) -> anyhow::Result<ClusterResult> {
    let timeout = args.node_timeout_ms.to_string();
    let coverage = if args.full_coverage { "yes" } else { "no" };
    let mut cluster = tokio::task::spawn_blocking(move || {
        RedisCluster::start_replicated(&[
            "--cluster-node-timeout",
            &timeout,
            "--cluster-require-full-coverage",
            coverage,
        ])
    })
    .await??;
    let dir = TempDir::new("cluster-faults")?;
    let text = config_text(args);
    let config_path = dir.0.join("cluster.toml");
    std::fs::write(&config_path, &text)?;
    let config = Config::from_toml(&text)?;
    let slots = key_slots(&config, args.keys)?;
    let seeds = cluster.urls()[..3].join(",");
    let flags: Vec<String> = [
        "--config",
        &config_path.display().to_string(),
        "--backend",
        "lua",
        "--redis-cluster",
        &seeds,
        "--redis-prefix",
        &format!("cluster:{}:{run_id}:", std::process::id()),
        "--failure-mode",
        "local",
        "--failure-instances",
        "2",
        "--failure-deadline",
        &args.deadline,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let instances = crate::instances::start(2, &flags).context("starting instances")?;
    let http = reqwest::Client::new();
    for url in &instances.urls {
        // Connected, and the slot map read, before the clock starts.
        let deadline = Instant::now() + Duration::from_secs(10);
        while http.get(format!("{url}/readyz")).send().await?.status() != 200 {
            ensure!(Instant::now() < deadline, "{url} is not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let urls: Arc<Vec<String>> = Arc::new(
        instances
            .urls
            .iter()
            .map(|u| format!("{u}/api/items"))
            .collect(),
    );
    let start = Instant::now();
    let wall_start = SystemTime::now().duration_since(UNIX_EPOCH)?.as_micros() as u64;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = tokio::spawn({
        let (urls, args, stop) = (Arc::clone(&urls), args.clone(), Arc::clone(&stop));
        async move { drive(urls, &args, start, stop).await }
    });
    tokio::time::sleep(Duration::from_secs_f64(args.before)).await;
    let fault_at = start.elapsed();
    eprintln!(
        "cluster-faults: {} at +{:.3} s",
        fault.as_str(),
        fault_at.as_secs_f64()
    );
    let fault_node =
        matches!(fault, Fault::Kill).then(|| format!("127.0.0.1:{}", cluster.nodes[0].port));
    let watch_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn(watch_readiness(
        instances.urls.clone(),
        Arc::clone(&watch_stop),
    ));
    let slots_for_fault = slots.clone();
    let (touched, took, cluster) = tokio::task::spawn_blocking(move || {
        let (touched, took) = inject(fault, &mut cluster, &slots_for_fault)?;
        anyhow::Ok((touched, took, cluster))
    })
    .await??;
    tokio::time::sleep(Duration::from_secs_f64(args.after)).await;
    stop.store(true, Ordering::Relaxed);
    watch_stop.store(true, Ordering::Relaxed);
    let samples = load.await??;
    let degraded = watcher.await?;
    drop(instances);
    drop(cluster);

    // One exact bucket per key, fed the same requests at the same instants.
    let limit = Limit::per_second(args.burst, args.rate)?;
    let mut states = vec![None; args.keys];
    let mut ideal = Vec::with_capacity(samples.len());
    for s in &samples {
        let now = wall_start + s.sent.as_micros() as u64;
        let (d, next) = token_bucket::check(&limit, states[s.key], 1, now)?;
        states[s.key] = Some(next);
        ideal.push(d.allowed);
    }
    Ok(ClusterResult {
        fault: fault.as_str().into(),
        fault_node,
        degraded,
        fault_ms: took.as_secs_f64() * 1000.0,
        touched: figures(&samples, &ideal, &touched, true, fault_at),
        untouched: figures(&samples, &ideal, &touched, false, fault_at),
    })
}

/// Runs every scenario and prints (and optionally saves) the table.
pub async fn run(args: ClusterArgs) -> anyhow::Result<Vec<ClusterResult>> {
    let faults = args
        .faults
        .iter()
        .map(|f| Fault::parse(f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    ensure!(
        args.burst >= 2,
        "--burst must be at least 2 (the local share is half)"
    );
    let mut results = Vec::new();
    for (run_id, fault) in faults.into_iter().enumerate() {
        results.push(scenario(fault, &args, run_id).await?);
    }
    print!("{}", markdown(&args, &results));
    if let Some(path) = &args.csv {
        std::fs::write(path, csv(&results))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(results)
}

fn markdown(args: &ClusterArgs, results: &[ClusterResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "3 masters + 3 replicas (cluster-node-timeout {} ms, cluster-require-full-coverage {}), 2 instances (local share {}), {} keys at burst {} and {}/s, {} clients at {} req/s; {:.1} s before the fault, {:.1} s after it is done; deadline {}\n",
        args.node_timeout_ms,
        if args.full_coverage { "yes" } else { "no" },
        (args.burst / 2).max(1),
        args.keys,
        args.burst,
        args.rate,
        args.clients,
        args.qps,
        args.before,
        args.after,
        args.deadline,
    );
    out.push_str("| fault | took, ms | /readyz named degraded | keys | requests | errors | local answers | last local, ms after the fault | admitted | exact bucket | worst key over exact |\n");
    out.push_str("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in results {
        let degraded = if r.degraded.is_empty() {
            "none".to_owned()
        } else {
            r.degraded.join(", ")
        };
        for (who, f) in [("touched", &r.touched), ("others", &r.untouched)] {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {degraded} | {who}: {} | {} | {} | {} | {:.0} | {} | {} | {} |",
                r.fault,
                r.fault_ms,
                f.keys,
                f.requests,
                f.errors,
                f.local,
                f.local_until_ms,
                f.admitted,
                f.ideal,
                f.worst_key_excess,
            );
        }
    }
    out
}

fn csv(results: &[ClusterResult]) -> String {
    let mut out = String::from(
        "fault,fault_ms,fault_node,readyz_degraded,keys,touched_keys,touched_requests,touched_errors,touched_local,touched_local_until_ms,touched_admitted,touched_ideal,touched_worst_excess,other_keys,other_requests,other_errors,other_local,other_local_until_ms,other_admitted,other_ideal,other_worst_excess\n",
    );
    for r in results {
        let _ = write!(
            out,
            "{},{:.1},{},{},{}",
            r.fault,
            r.fault_ms,
            r.fault_node.as_deref().unwrap_or(""),
            r.degraded.join(";"),
            r.touched.keys + r.untouched.keys
        );
        for f in [&r.touched, &r.untouched] {
            let _ = write!(
                out,
                ",{},{},{},{},{:.1},{},{},{}",
                f.keys,
                f.requests,
                f.errors,
                f.local,
                f.local_until_ms,
                f.admitted,
                f.ideal,
                f.worst_key_excess
            );
        }
        out.push('\n');
    }
    out
}
