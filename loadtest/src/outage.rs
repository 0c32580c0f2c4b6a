//! Redis faults under load, measured: `cargo run -p loadtest -- outage`.
//!
//! Each scenario starts its own redis-server and K API instances (separate
//! processes, `--backend lua`), drives one API key at a steady rate well
//! above its limit from C clients round-robin over the instances, injects a
//! fault for a while, removes it, and keeps going. Faults:
//!
//! - `kill`: SIGKILL redis-server, later start a fresh (empty) one on the
//!   same port: connections reset, data lost;
//! - `stop`: SIGSTOP, later SIGCONT: a hung Redis (connections open, no
//!   answers);
//! - `latency`: a [`FaultProxy`] between the instances and Redis adds delay
//!   to every byte (a slow Redis);
//! - `blackhole`: the proxy holds every byte (an unreachable Redis).
//!
//! What it reports per scenario, from the responses alone:
//! - admitted requests during the outage and over the whole run, beside
//!   what one exact token bucket admits for the same requests at the same
//!   instants (`ideal`: the pure core replayed over the send times), so the
//!   ratio is the over-admission the fault caused; and the same after the
//!   fault ended (fail-open's bypass until the hand-back aside), where a
//!   bucket handed back full (a fresh burst) shows;
//! - who decided during the outage, read from the answers: `RateLimit-Limit`
//!   equal to the burst is the shared bucket, equal to the local share is the
//!   fallback, a 200 without rate headers is fail-open, a 503 fail-closed;
//! - latency during the outage (p50, p99, max); how long after the fault
//!   ended every instance had answered from Redis again (the hand-back), and
//!   how many answers after that still did not come from Redis (single
//!   checks missing the deadline on a busy machine);
//! - errors: transport failures and 5xx, except fail-closed's deliberate 503.
//!
//! Instances run with the service defaults (deadline 10 ms, Redis response
//! timeout 50 ms, breaker cooldown 500 ms) unless told otherwise; with
//! `--response-timeout 2s` the client library's own timeout is out of the
//! picture and the deadline alone bounds how long a request waits.

use crate::proxy::FaultProxy;
use anyhow::{Context, bail};
use ratelimiter::algorithm::Limit;
use ratelimiter::algorithm::token_bucket;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use testkit::{RedisServer, TempDir};

/// The outage command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct OutageArgs {
    /// Scenarios as fault:mode (faults: kill, stop, latency, blackhole;
    /// modes: local, open, closed)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kill:local,kill:open,kill:closed,stop:local,latency:local,blackhole:local"
    )]
    pub scenarios: Vec<String>,
    /// API instances (the local share is 1/K of the limit)
    #[arg(long, default_value_t = 3)]
    pub instances: usize,
    /// The policy's burst
    #[arg(long, default_value_t = 40)]
    pub burst: u64,
    /// The policy's rate, tokens per second
    #[arg(long, default_value_t = 40)]
    pub rate: u64,
    /// Concurrent clients
    #[arg(long, default_value_t = 6)]
    pub clients: usize,
    /// Total requests per second the clients aim at
    #[arg(long, default_value_t = 600)]
    pub qps: u64,
    /// Seconds of traffic before the fault
    #[arg(long, default_value_t = 1.5)]
    pub before: f64,
    /// Seconds the fault lasts
    #[arg(long, default_value_t = 3.0)]
    pub outage: f64,
    /// Seconds of traffic after the fault ends
    #[arg(long, default_value_t = 3.0)]
    pub after: f64,
    /// The instances' `--failure-deadline`
    #[arg(long, default_value = "10ms")]
    pub deadline: String,
    /// The instances' `--redis-response-timeout` (the client library's own
    /// timeout; set it far above the deadline to show the deadline alone
    /// bounds the wait)
    #[arg(long, default_value = "50ms")]
    pub response_timeout: String,
    /// Latency the proxy adds, each way, in the `latency` fault (ms)
    #[arg(long, default_value_t = 50)]
    pub latency_ms: u64,
    /// Also write the table as CSV to this file
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Stop,
    Latency,
    Blackhole,
}

impl Fault {
    fn parse(text: &str) -> anyhow::Result<Self> {
        Ok(match text {
            "kill" => Fault::Kill,
            "stop" => Fault::Stop,
            "latency" => Fault::Latency,
            "blackhole" => Fault::Blackhole,
            other => bail!("unknown fault {other:?} (kill, stop, latency, blackhole)"),
        })
    }
    fn as_str(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::Latency => "latency",
            Fault::Blackhole => "blackhole",
        }
    }
}

/// Who answered one request, as read from the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Redis,
    Local,
    FailOpen,
    FailClosed,
    Error,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Since the start of the run.
    sent: Duration,
    latency: Duration,
    admitted: bool,
    source: Source,
    instance: usize,
}

/// One scenario's figures (see the module docs).
#[derive(Debug, Clone)]
pub struct OutageResult {
    /// Fault name.
    pub fault: String,
    /// Failure mode.
    pub mode: String,
    /// Requests sent.
    pub requests: usize,
    /// Transport errors and 5xx other than fail-closed 503s.
    pub errors: usize,
    /// Fail-closed 503s.
    pub failclosed: usize,
    /// Requests sent during the outage.
    pub outage_requests: usize,
    /// Of those, decided by Redis / the local share / failed open.
    pub outage_sources: [usize; 3],
    /// Admitted during the outage.
    pub admitted_outage: usize,
    /// What one exact bucket admits for the same outage requests.
    pub ideal_outage: usize,
    /// Admitted over the whole run.
    pub admitted_total: usize,
    /// What one exact bucket admits over the whole run.
    pub ideal_total: usize,
    /// Of the requests sent after the fault ended, admitted by a limit
    /// (Redis or the local share; fail-open's bypass until the breaker's
    /// probe is not counted): the hand-back, where a fresh burst shows.
    pub admitted_after: usize,
    /// What one exact bucket admits for those same requests.
    pub ideal_after: usize,
    /// Latency during the outage, ms: p50, p99, max.
    pub outage_latency_ms: [f64; 3],
    /// From the fault's end until every instance has answered from Redis
    /// again, ms (`None`: some never did).
    pub recovery_ms: Option<f64>,
    /// Answers not from Redis after an instance's hand-back (checks that
    /// missed the deadline in normal operation).
    pub strays: usize,
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        f64::NAN
    } else {
        a as f64 / b as f64
    }
}

fn config_file(dir: &TempDir, args: &OutageArgs) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.0.join("outage.toml");
    std::fs::write(
        &path,
        format!(
            "key_secret = \"outage-scenario-shared-secret\"\n\
             [[api_keys]]\nid = \"tenant\"\nkey = \"outage-key\"\n\
             [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {}\nrate = {}\n",
            args.burst, args.rate
        ),
    )?;
    Ok(path)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

/// One answer of a [`steady`] run, before anyone reads who decided it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answer {
    /// The request's number over all clients, as `request` was given it.
    pub n: usize,
    /// Since the start of the run.
    pub sent: Duration,
    pub latency: Duration,
    /// `None`: no answer (a transport error).
    pub status: Option<u16>,
    /// Its `RateLimit-Limit`, if any.
    pub limit: Option<u64>,
}

/// Makes the n-th request of a [`steady`] run (its URL and headers).
pub(crate) type MakeRequest =
    Arc<dyn Fn(&reqwest::Client, usize) -> reqwest::RequestBuilder + Send + Sync>;

/// Steady load: `clients` tasks, each sending every `clients / qps`
/// seconds from `start`, the n-th request over all of them made by
/// `request` (its URL and headers), until `done` says so after a tick.
pub(crate) async fn steady(
    clients: usize,
    qps: u64,
    start: Instant,
    done: Arc<dyn Fn() -> bool + Send + Sync>,
    request: MakeRequest,
) -> anyhow::Result<Vec<Answer>> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(clients)
        .build()?;
    let next = Arc::new(AtomicUsize::new(0));
    let interval = Duration::from_secs_f64(clients as f64 / qps.max(1) as f64);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (http, next, done, request) = (
            http.clone(),
            Arc::clone(&next),
            Arc::clone(&done),
            Arc::clone(&request),
        );
        tasks.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::from_std(start) + interval.mul_f64(c as f64 / clients as f64),
                interval,
            );
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if done() {
                    break;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                let sent = Instant::now();
                let response = request(&http, n).send().await;
                let latency = sent.elapsed();
                let (status, limit) = match response {
                    Err(_) => (None, None),
                    Ok(r) => (
                        Some(r.status().as_u16()),
                        r.headers()
                            .get("ratelimit-limit")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<u64>().ok()),
                    ),
                };
                answers.push(Answer {
                    n,
                    sent: sent - start,
                    latency,
                    status,
                    limit,
                });
            }
            answers
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    all.sort_by_key(|a| a.sent);
    Ok(all)
}

/// Steady load on the one API key, round-robin over `urls`, until
/// `stop_at`; who answered read from `RateLimit-Limit` (the burst: Redis;
/// the local share's; none on a 200: failed open) and the status.
async fn drive(
    urls: Arc<Vec<String>>,
    args: &OutageArgs,
    share_burst: u64,
    start: Instant,
    stop_at: Instant,
) -> anyhow::Result<Vec<Sample>> {
    let instances = urls.len();
    let answers = steady(
        args.clients,
        args.qps,
        start,
        Arc::new(move || Instant::now() >= stop_at),
        Arc::new(move |http, n| {
            http.get(&urls[n % urls.len()])
                .header("x-api-key", "outage-key")
        }),
    )
    .await?;
    let burst = args.burst;
    Ok(answers
        .into_iter()
        .map(|a| {
            let source = match (a.status, a.limit) {
                (None, _) => Source::Error,
                (Some(503), _) => Source::FailClosed,
                (Some(200 | 429), Some(l)) if l == burst => Source::Redis,
                (Some(200 | 429), Some(l)) if l == share_burst => Source::Local,
                (Some(200), None) => Source::FailOpen,
                _ => Source::Error,
            };
            Sample {
                sent: a.sent,
                latency: a.latency,
                admitted: a.status == Some(200),
                source,
                instance: a.n % instances,
            }
        })
        .collect())
}

/// Progress on stderr, with wall-clock times to line up with instance logs.
fn report_progress(fault: Fault, mode: &str, from: Duration, to: Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    eprintln!(
        "outage: {} / {mode}: fault from +{:.3} s to +{:.3} s (restored at unix {now:.3})",
        fault.as_str(),
        from.as_secs_f64(),
        to.as_secs_f64()
    );
}

async fn scenario(
    fault: Fault,
    mode: &str,
    args: &OutageArgs,
    config: &std::path::Path,
    run_id: usize,
) -> anyhow::Result<OutageResult> {
    let mut redis = RedisServer::start()?;
    let proxy = match fault {
        Fault::Latency | Fault::Blackhole => {
            let upstream: SocketAddr = format!("127.0.0.1:{}", redis.port).parse()?;
            Some(FaultProxy::start(upstream).await?)
        }
        Fault::Kill | Fault::Stop => None,
    };
    let redis_url = proxy
        .as_ref()
        .map_or_else(|| redis.url(), FaultProxy::redis_url);
    let flags: Vec<String> = [
        "--config",
        &config.display().to_string(),
        "--backend",
        "lua",
        "--redis-url",
        &redis_url,
        "--redis-prefix",
        &format!("outage:{}:{run_id}:", std::process::id()),
        "--redis-response-timeout",
        &args.response_timeout,
        "--failure-mode",
        mode,
        "--failure-instances",
        &args.instances.to_string(),
        "--failure-deadline",
        &args.deadline,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let instances =
        crate::instances::start(args.instances, &flags).context("starting instances")?;
    let share_burst = (args.burst / args.instances as u64).max(1);
    if share_burst == args.burst {
        bail!("with one instance the local share equals the limit; use --instances 2 or more");
    }
    // Every instance connected to Redis before the clock starts.
    let http = reqwest::Client::new();
    for url in &instances.urls {
        let ready = http.get(format!("{url}/readyz")).send().await?;
        anyhow::ensure!(ready.status() == 200, "{url} is not ready");
    }
    let urls: Arc<Vec<String>> = Arc::new(
        instances
            .urls
            .iter()
            .map(|u| format!("{u}/api/items"))
            .collect(),
    );

    let start = Instant::now();
    let fault_at = start + Duration::from_secs_f64(args.before);
    let back_at = fault_at + Duration::from_secs_f64(args.outage);
    let stop_at = back_at + Duration::from_secs_f64(args.after);
    let wall_start = SystemTime::now().duration_since(UNIX_EPOCH)?.as_micros() as u64;
    let load = drive(Arc::clone(&urls), args, share_burst, start, stop_at);
    let control = async {
        tokio::time::sleep_until(fault_at.into()).await;
        match fault {
            Fault::Kill => redis.kill()?,
            Fault::Stop => redis.pause()?,
            Fault::Latency => proxy
                .as_ref()
                .context("proxy")?
                .set_latency(Duration::from_millis(args.latency_ms)),
            Fault::Blackhole => proxy.as_ref().context("proxy")?.set_blackhole(true),
        }
        let injected = Instant::now();
        tokio::time::sleep_until(back_at.into()).await;
        match fault {
            // Restarting takes a moment; the outage ends when it listens.
            Fault::Kill => redis.restart()?,
            Fault::Stop => redis.resume()?,
            Fault::Latency => proxy.as_ref().context("proxy")?.set_latency(Duration::ZERO),
            Fault::Blackhole => proxy.as_ref().context("proxy")?.set_blackhole(false),
        }
        let restored = Instant::now();
        report_progress(fault, mode, injected - start, restored - start);
        anyhow::Ok((injected - start, restored - start))
    };
    let (samples, phases) = tokio::join!(load, control);
    let (samples, (from, to)) = (samples?, phases?);
    drop(instances);

    // One exact bucket fed the same requests at the same instants.
    let limit = Limit::per_second(args.burst, args.rate)?;
    let mut state = None;
    let mut ideal = Vec::with_capacity(samples.len());
    for s in &samples {
        let now = wall_start + s.sent.as_micros() as u64;
        let (d, next) = token_bucket::check(&limit, state, 1, now)?;
        state = Some(next);
        ideal.push(d.allowed);
    }
    let during = |s: &Sample| s.sent >= from && s.sent < to;
    let outage: Vec<(usize, &Sample)> = samples
        .iter()
        .enumerate()
        .filter(|(_, s)| during(s))
        .collect();
    let mut latencies: Vec<Duration> = outage.iter().map(|(_, s)| s.latency).collect();
    latencies.sort();
    let count = |source: Source| outage.iter().filter(|(_, s)| s.source == source).count();

    // Hand-back: per instance, when its first Redis-decided answer to a
    // request sent after the fault ended arrived. Answers not from Redis
    // after that are counted apart: single checks that missed the deadline
    // on a busy machine, not the outage.
    let mut recovery = Duration::ZERO;
    let mut recovered = true;
    let mut strays = 0;
    for instance in 0..args.instances {
        let after: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.instance == instance && s.sent >= to)
            .collect();
        match after.iter().position(|s| s.source == Source::Redis) {
            None => recovered = false,
            Some(i) => {
                let s = after[i];
                recovery = recovery.max((s.sent + s.latency).saturating_sub(to));
                strays += after[i..]
                    .iter()
                    .filter(|s| s.source != Source::Redis)
                    .count();
            }
        }
    }
    let errors = samples
        .iter()
        .filter(|s| {
            s.source == Source::Error || (s.source == Source::FailClosed && mode != "closed")
        })
        .count();
    Ok(OutageResult {
        fault: fault.as_str().into(),
        mode: mode.into(),
        requests: samples.len(),
        errors,
        failclosed: samples
            .iter()
            .filter(|s| s.source == Source::FailClosed)
            .count(),
        outage_requests: outage.len(),
        outage_sources: [
            count(Source::Redis),
            count(Source::Local),
            count(Source::FailOpen),
        ],
        admitted_outage: outage.iter().filter(|(_, s)| s.admitted).count(),
        ideal_outage: outage.iter().filter(|(i, _)| ideal[*i]).count(),
        admitted_total: samples.iter().filter(|s| s.admitted).count(),
        ideal_total: ideal.iter().filter(|a| **a).count(),
        admitted_after: samples
            .iter()
            .filter(|s| s.sent >= to && s.admitted && s.source != Source::FailOpen)
            .count(),
        ideal_after: samples
            .iter()
            .zip(&ideal)
            .filter(|(s, i)| s.sent >= to && **i)
            .count(),
        outage_latency_ms: [
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            latencies
                .last()
                .map_or(f64::NAN, |l| l.as_secs_f64() * 1000.0),
        ],
        recovery_ms: recovered.then_some(recovery.as_secs_f64() * 1000.0),
        strays,
    })
}

/// Runs every scenario and prints (and optionally saves) the table.
pub async fn run(args: OutageArgs) -> anyhow::Result<Vec<OutageResult>> {
    let mut plan = Vec::new();
    for s in &args.scenarios {
        let (fault, mode) = s
            .split_once(':')
            .with_context(|| format!("scenario {s:?} is not fault:mode"))?;
        if !["local", "open", "closed"].contains(&mode) {
            bail!("unknown failure mode {mode:?} (local, open, closed)");
        }
        plan.push((Fault::parse(fault)?, mode.to_owned()));
    }
    let dir = TempDir::new("outage")?;
    let config = config_file(&dir, &args)?;
    let mut results = Vec::new();
    for (run_id, (fault, mode)) in plan.into_iter().enumerate() {
        eprintln!("outage: {} / {mode} ...", fault.as_str());
        results.push(scenario(fault, &mode, &args, &config, run_id).await?);
    }
    print!("{}", markdown(&args, &results));
    if let Some(path) = &args.csv {
        std::fs::write(path, csv(&results))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(results)
}

fn markdown(args: &OutageArgs, results: &[OutageResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} instances, burst {} at {}/s (local share {}), {} clients at {} req/s; {:.1} s before, {:.1} s of fault, {:.1} s after; deadline {}, Redis response timeout {}\n",
        args.instances,
        args.burst,
        args.rate,
        (args.burst / args.instances as u64).max(1),
        args.clients,
        args.qps,
        args.before,
        args.outage,
        args.after,
        args.deadline,
        args.response_timeout
    );
    out.push_str("| fault | mode | requests | errors | 503 closed | outage: redis / local / open | admitted outage | ideal outage | ratio outage | admitted total | ideal total | ratio total | admitted after | ideal after | outage p50 ms | outage p99 ms | outage max ms | back on Redis after, ms | not Redis after that |\n");
    out.push_str(
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} / {} / {} | {} | {} | {:.2} | {} | {} | {:.2} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} |",
            r.fault,
            r.mode,
            r.requests,
            r.errors,
            r.failclosed,
            r.outage_sources[0],
            r.outage_sources[1],
            r.outage_sources[2],
            r.admitted_outage,
            r.ideal_outage,
            ratio(r.admitted_outage, r.ideal_outage),
            r.admitted_total,
            r.ideal_total,
            ratio(r.admitted_total, r.ideal_total),
            r.admitted_after,
            r.ideal_after,
            r.outage_latency_ms[0],
            r.outage_latency_ms[1],
            r.outage_latency_ms[2],
            r.recovery_ms
                .map_or_else(|| "never".to_owned(), |ms| format!("{ms:.0}")),
            r.strays,
        );
    }
    out
}

fn csv(results: &[OutageResult]) -> String {
    let mut out = String::from(
        "fault,mode,requests,errors,failclosed,outage_requests,outage_redis,outage_local,outage_failopen,admitted_outage,ideal_outage,admitted_total,ideal_total,admitted_after,ideal_after,outage_p50_ms,outage_p99_ms,outage_max_ms,recovery_ms,strays\n",
    );
    for r in results {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{},{}",
            r.fault,
            r.mode,
            r.requests,
            r.errors,
            r.failclosed,
            r.outage_requests,
            r.outage_sources[0],
            r.outage_sources[1],
            r.outage_sources[2],
            r.admitted_outage,
            r.ideal_outage,
            r.admitted_total,
            r.ideal_total,
            r.admitted_after,
            r.ideal_after,
            r.outage_latency_ms[0],
            r.outage_latency_ms[1],
            r.outage_latency_ms[2],
            r.recovery_ms
                .map_or_else(String::new, |ms| format!("{ms:.1}")),
            r.strays,
        );
    }
    out
}
