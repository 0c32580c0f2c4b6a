//! `capacity`: at what rate does the synchronous Redis check, not the
//! application, bound one instance's throughput?
//!
//! Every limited request waits for its check: one Redis round trip. An
//! instance serving `in-flight` requests at once can therefore complete at
//! most `in-flight / RTT` of them per second, however idle its CPU. This
//! command measures where the knee really is.
//!
//! - One instance per variant, started here (this executable re-run as
//!   `loadtest instance`): no limiter (an unlimited route), the memory
//!   limiter, and the Lua limiter on a real redis-server behind the
//!   latency-injecting proxy of the fault scenarios, with 0, 0.5, 1 and
//!   2 ms added to each round trip.
//! - An open-loop load: requests are offered at a fixed rate, stepped up,
//!   with at most `--in-flight` outstanding (the instance's concurrency);
//!   an offer that finds them all busy is not sent. A closed loop (goose's
//!   users) would slow down with the server and never show the knee.
//! - Per step: the offered and achieved rates, request p50/p99 seen here,
//!   check p50/p99 from the instance's own histogram, the mean requests in
//!   flight (Little's law), the machine's and the instance's CPU, and what
//!   bounds the point: nothing (it kept up), the round trip, the requests
//!   in flight, or the CPU.

use crate::instances;
use crate::proxy::FaultProxy;
use crate::results::{self, Chart, Table};
use crate::traffic::Latency;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};
use testkit::{RedisServer, TempDir};
use tokio::sync::Semaphore;

#[derive(Debug, Args)]
pub struct CapacityArgs {
    /// Round-trip latencies added between the instance and Redis, ms
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,1,2")]
    pub rtts: Vec<f64>,
    /// Offered rates, requests per second, in steps
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "250,500,1000,2000,3000,4000,6000,8000,12000,16000"
    )]
    pub rates: Vec<u64>,
    /// Seconds per step
    #[arg(long, default_value_t = 3.0)]
    pub step: f64,
    /// Most requests outstanding at once (the instance's concurrency)
    #[arg(long, default_value_t = 8)]
    pub in_flight: usize,
    /// Where the results go [default: results/capacity-<UTC time>]
    #[arg(long)]
    pub results: Option<PathBuf>,
}

/// What bounds a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// It kept up with the offered rate.
    Offered,
    /// Requests waited on the Redis round trip with every slot in flight.
    RoundTrip,
    /// The machine's CPU was saturated.
    Cpu,
    /// Every slot was in flight, and neither the round trip nor the CPU
    /// explains it.
    InFlight,
    /// Neither the slots nor the CPU were full, yet the offer was not met:
    /// the load generator could not send it (or something unmeasured).
    Generator,
}

impl Bound {
    pub fn name(self) -> &'static str {
        match self {
            Bound::Offered => "-",
            Bound::RoundTrip => "round trip",
            Bound::Cpu => "CPU",
            Bound::InFlight => "in flight",
            Bound::Generator => "generator?",
        }
    }
}

/// One step's measurements.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Point {
    pub offered: f64,
    pub achieved: f64,
    /// Mean request latency, seconds.
    pub mean_latency: f64,
    /// Busy fraction of all the machine's cores, from the processes in the
    /// measurement (generator, instance, redis-server).
    pub machine_cpu: f64,
    /// Share of the offers that found every slot in flight (not sent).
    pub turned_away: f64,
}

/// A point kept up when it achieved this share of the offer.
const KEPT_UP: f64 = 0.95;

/// Mean requests in flight (Little's law: rate times time in the system).
pub fn mean_in_flight(p: &Point) -> f64 {
    p.achieved * p.mean_latency
}

/// The throughput bound the round trip sets: `in_flight / rtt`.
pub fn rtt_bound(in_flight: usize, rtt: Duration) -> Option<f64> {
    (!rtt.is_zero()).then(|| in_flight as f64 / rtt.as_secs_f64())
}

/// What bounds `p`, for an instance whose checks each wait `rtt` on Redis.
/// The slots were full if offers were turned away for want of one (the
/// mean in flight stays below the cap: offers come in bursts).
pub fn bound_by(p: &Point, rtt: Duration) -> Bound {
    if p.achieved >= KEPT_UP * p.offered {
        return Bound::Offered;
    }
    let saturated = p.turned_away >= 0.05;
    if saturated && !rtt.is_zero() && rtt.as_secs_f64() >= 0.5 * p.mean_latency {
        Bound::RoundTrip
    } else if p.machine_cpu >= 0.85 {
        Bound::Cpu
    } else if saturated {
        Bound::InFlight
    } else {
        Bound::Generator
    }
}

/// The knee of a series: the first offer it did not keep up with, and the
/// most it achieved (its capacity). `None` if it kept up throughout.
pub fn knee(points: &[Point]) -> Option<(f64, f64)> {
    let first = points.iter().find(|p| p.achieved < KEPT_UP * p.offered)?;
    let most = points.iter().map(|p| p.achieved).fold(0.0, f64::max);
    Some((first.offered, most))
}

/// The check latency histogram of an instance's `/metrics`, summed over
/// labels: (upper bound, cumulative count) pairs.
pub fn check_buckets(metrics: &str) -> Vec<(f64, f64)> {
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("ratelimit_check_duration_seconds_bucket{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Some(le) = labels
            .split(',')
            .find_map(|l| l.strip_prefix("le=\""))
            .map(|l| l.trim_end_matches('"'))
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some((_, v)) => *v += value,
            None => buckets.push((le, value)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// The `q` quantile of the observations between two scrapes of the same
/// histogram, interpolated within a bucket as Prometheus's
/// `histogram_quantile` does. `None` without observations.
pub fn quantile_between(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, v)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, v)| *v);
            (*le, v - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in &delta {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let in_bucket = count - lower.1;
            let fraction = if in_bucket > 0.0 {
                (rank - lower.1) / in_bucket
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * fraction);
        }
        lower = (le, count);
    }
    None
}

/// CPU time (seconds) of a process so far, from /proc.
pub(crate) fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ
}

/// CPU seconds used so far by the processes that share the machine in a
/// step: this load generator, the instance and redis-server. (The machine's
/// own /proc/stat counters proved unreliable on the test VM: steps with a
/// busy instance read 0 %.)
fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&p| process_cpu(p)).sum()
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// The median of 200 PING round trips to `addr` (a Redis, or the proxy).
async fn ping_rtt(addr: std::net::SocketAddr) -> anyhow::Result<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut times = Vec::with_capacity(200);
    let mut pong = [0u8; 7];
    for _ in 0..200 {
        let sent = Instant::now();
        s.write_all(b"PING\r\n").await?;
        s.read_exact(&mut pong).await?;
        anyhow::ensure!(&pong == b"+PONG\r\n", "not a PONG: {pong:?}");
        times.push(sent.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// One variant under test.
struct Variant {
    name: String,
    /// The round trip added by the proxy (nominal).
    rtt: Duration,
    base: String,
    path: &'static str,
    pid: u32,
    /// Every process of the measurement: this one, the instance, Redis.
    sharing: Vec<u32>,
}

/// One step's full row.
struct Row {
    point: Point,
    req_p50: Option<u64>,
    req_p99: Option<u64>,
    check_p50: Option<f64>,
    check_p99: Option<f64>,
    instance_cores: f64,
    errors: u64,
}

async fn scrape(http: &reqwest::Client, base: &str) -> Vec<(f64, f64)> {
    match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => check_buckets(&r.text().await.unwrap_or_default()),
        Err(_) => Vec::new(),
    }
}

/// Offers `rate` requests per second for `seconds`, at most `in_flight`
/// outstanding.
async fn step(
    http: &reqwest::Client,
    v: &Variant,
    rate: u64,
    seconds: f64,
    in_flight: usize,
) -> Row {
    let url = format!("{}{}", v.base, v.path);
    let slots = Arc::new(Semaphore::new(in_flight));
    let latency = Arc::new(Latency::default());
    let mut turned_away = 0u64;
    let mut offers = 0u64;
    let (ok, errors, total_us) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let before = scrape(http, &v.base).await;
    let cpu_before = cpu_of(&v.sharing);
    let proc_before = process_cpu(v.pid);
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let until = start + Duration::from_secs_f64(seconds);
    // The offers are paced by a thread of their own: tokio's timer ticks
    // in milliseconds, so 8000/s would arrive as bursts of 8 or more, and a
    // burst larger than the slots would be turned away by the generator,
    // not the server. A thread sleeps to each offer's instant (the OS's
    // high-resolution timer) and hands it over.
    let (offer, mut offered) = tokio::sync::mpsc::unbounded_channel::<()>();
    let pacer = std::thread::spawn(move || {
        let mut next = start;
        while next < until {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            if offer.send(()).is_err() {
                break;
            }
            next += interval;
        }
    });
    while offered.recv().await.is_some() {
        offers += 1;
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            turned_away += 1;
            continue;
        };
        let (http, url) = (http.clone(), url.clone());
        let (latency, ok, errors, total_us) = (
            Arc::clone(&latency),
            Arc::clone(&ok),
            Arc::clone(&errors),
            Arc::clone(&total_us),
        );
        tokio::spawn(async move {
            let sent = Instant::now();
            let result = http
                .get(&url)
                .header("x-api-key", "capacity-key")
                .send()
                .await;
            let good = matches!(&result, Ok(r) if r.status().is_success());
            if let Ok(r) = result {
                let _ = r.bytes().await;
            }
            let us = sent.elapsed().as_micros() as u64;
            if good {
                latency.record(us);
                total_us.fetch_add(us, Ordering::Relaxed);
                ok.fetch_add(1, Ordering::Relaxed);
            } else {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            drop(permit);
        });
    }
    let _ = pacer.join();
    // Let the last ones finish, then measure the whole time.
    let _all = slots.acquire_many(in_flight as u32).await;
    let elapsed = start.elapsed().as_secs_f64();
    let after = scrape(http, &v.base).await;
    let machine = (cpu_of(&v.sharing) - cpu_before) / (elapsed * cores());
    let cores = match (proc_before, process_cpu(v.pid)) {
        (Some(a), Some(b)) => (b - a) / elapsed,
        _ => f64::NAN,
    };
    let done = ok.load(Ordering::Relaxed);
    Row {
        point: Point {
            offered: rate as f64,
            achieved: done as f64 / elapsed,
            mean_latency: if done == 0 {
                0.0
            } else {
                total_us.load(Ordering::Relaxed) as f64 / done as f64 / 1e6
            },
            machine_cpu: machine,
            turned_away: turned_away as f64 / offers.max(1) as f64,
        },
        req_p50: latency.quantile(0.5),
        req_p99: latency.quantile(0.99),
        check_p50: quantile_between(&before, &after, 0.5),
        check_p99: quantile_between(&before, &after, 0.99),
        instance_cores: cores,
        errors: errors.load(Ordering::Relaxed),
    }
}

/// The baseline's config: the same route, unlimited.
fn unlimited_config(dir: &TempDir) -> anyhow::Result<PathBuf> {
    let path = dir.join("unlimited.toml");
    std::fs::write(
        &path,
        "key_secret = \"capacity-scenario-shared-secret\"\n\
         [[api_keys]]\nid = \"tenant\"\nkey = \"capacity-key\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nunlimited = true\n",
    )?;
    Ok(path)
}

fn config(dir: &TempDir) -> anyhow::Result<PathBuf> {
    let path = dir.join("capacity.toml");
    // A limit no step reaches: the cost of checking, never of denying.
    std::fs::write(
        &path,
        "key_secret = \"capacity-scenario-shared-secret\"\n\
         [[api_keys]]\nid = \"tenant\"\nkey = \"capacity-key\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 1000000000\nrate = 1000000000\n\
         [[policies]]\nname = \"status\"\nroute = \"/api/status\"\nunlimited = true\n",
    )?;
    Ok(path)
}

pub async fn run(args: CapacityArgs) -> anyhow::Result<()> {
    // The instances are this executable: a dev build would measure a debug
    // limiter (the dev profile optimises dependencies, not the service).
    anyhow::ensure!(
        !cfg!(debug_assertions) || std::env::var_os("LOADTEST_ALLOW_DEBUG").is_some(),
        "capacity measures the service itself: run it from a release build, `cargo run --release -p loadtest -- capacity`"
    );
    anyhow::ensure!(
        !args.rates.is_empty() && args.in_flight > 0,
        "need --rates and --in-flight"
    );
    let dir = args.results.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!(
            "capacity-{}",
            results::timestamp(SystemTime::now())
        ))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = TempDir::new("capacity")?;
    let config = config(&scratch)?;
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse()?).await?;
    // A generous deadline: every check goes to Redis, however slow, so the
    // measurement is of the synchronous check (the service's default, 10
    // ms, would hand slow checks to the local share).
    let common = |backend: &str, config: &PathBuf| -> Vec<String> {
        let mut flags = vec![
            "--config".into(),
            config.display().to_string(),
            "--backend".into(),
            backend.into(),
            "--failure-deadline".into(),
            "1s".into(),
            "--redis-response-timeout".into(),
            "1s".into(),
        ];
        if backend == "lua" {
            flags.extend(["--redis-url".into(), proxy.redis_url()]);
        }
        flags
    };
    let unlimited = instances::start(1, &common("memory", &unlimited_config(&scratch)?))?;
    let memory = instances::start(1, &common("memory", &config))?;
    let lua = instances::start(1, &common("lua", &config))?;
    let generator = std::process::id();
    let redis_pid = redis.pid().context("redis-server has no pid")?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(args.in_flight)
        .build()?;

    let mut variants = vec![
        Variant {
            name: "no limiter".into(),
            rtt: Duration::ZERO,
            base: unlimited.urls[0].clone(),
            path: "/api/items",
            pid: unlimited.pids()[0],
            sharing: vec![generator, unlimited.pids()[0]],
        },
        Variant {
            name: "memory".into(),
            rtt: Duration::ZERO,
            base: memory.urls[0].clone(),
            path: "/api/items",
            pid: memory.pids()[0],
            sharing: vec![generator, memory.pids()[0]],
        },
    ];
    for rtt in &args.rtts {
        variants.push(Variant {
            name: format!("lua +{rtt} ms"),
            rtt: Duration::from_secs_f64(rtt / 1000.0),
            base: lua.urls[0].clone(),
            path: "/api/items",
            pid: lua.pids()[0],
            sharing: vec![generator, lua.pids()[0], redis_pid],
        });
    }

    let mut table = Table::new(&[
        "variant",
        "added rtt ms",
        "measured rtt ms",
        "offered/s",
        "achieved/s",
        "request p50 ms",
        "request p99 ms",
        "check p50 ms",
        "check p99 ms",
        "mean in flight",
        "turned away %",
        "CPU % (of all cores)",
        "instance cores",
        "errors",
        "bound by",
    ]);
    let mut series: Vec<(String, Option<Duration>, Vec<Row>)> = Vec::new();
    for v in &variants {
        // Half the added round trip each way; then what a round trip to
        // Redis through the proxy really takes (the bound uses this).
        proxy.set_latency(v.rtt / 2);
        let measured = if v.name.starts_with("lua") {
            Some(ping_rtt(proxy.addr).await?)
        } else {
            None
        };
        // Warm up: connections, the script cache.
        let _ = step(&http, v, 200, 0.5, args.in_flight).await;
        let mut rows = Vec::new();
        for &rate in &args.rates {
            let row = step(&http, v, rate, args.step, args.in_flight).await;
            let bound = bound_by(&row.point, measured.unwrap_or_default());
            eprintln!(
                "capacity: {} offered {rate}/s: {:.0}/s, p99 {} ms, {}",
                v.name,
                row.point.achieved,
                results::ms_from_us(row.req_p99),
                bound.name()
            );
            table.row(vec![
                v.name.clone(),
                if measured.is_some() {
                    format!("{}", v.rtt.as_secs_f64() * 1000.0)
                } else {
                    "-".into()
                },
                measured.map_or("-".into(), |m| format!("{:.3}", m.as_secs_f64() * 1000.0)),
                rate.to_string(),
                format!("{:.0}", row.point.achieved),
                results::ms_from_us(row.req_p50),
                results::ms_from_us(row.req_p99),
                results::ms_from_secs(row.check_p50),
                results::ms_from_secs(row.check_p99),
                format!("{:.1}", mean_in_flight(&row.point)),
                format!("{:.0}", row.point.turned_away * 100.0),
                format!("{:.0}", row.point.machine_cpu * 100.0),
                format!("{:.2}", row.instance_cores),
                row.errors.to_string(),
                bound.name().into(),
            ]);
            rows.push(row);
        }
        series.push((v.name.clone(), measured, rows));
    }
    drop((unlimited, memory, lua, proxy, redis));

    let mut knees = Table::new(&[
        "variant",
        "capacity/s",
        "first offer not met",
        "measured rtt ms",
        "in-flight / RTT bound",
        "capacity / bound",
        "bound at the knee",
        "instance CPU us per request",
        "x no limiter",
    ]);
    // The limiter's cost as a ratio: the instance's CPU per request at the
    // highest offer that both this variant and the baseline kept up with.
    let baseline = series.first().map(|(_, _, rows)| rows);
    let cpu_per_request = |r: &Row| r.instance_cores / r.point.achieved * 1e6;
    for (name, rtt, rows) in &series {
        let points: Vec<Point> = rows.iter().map(|r| r.point).collect();
        let rtt = rtt.unwrap_or_default();
        let bound = rtt_bound(args.in_flight, rtt);
        let (first, most) = knee(&points).map_or(
            (
                "kept up".to_owned(),
                points.iter().map(|p| p.achieved).fold(0.0, f64::max),
            ),
            |(f, m)| (format!("{f:.0}"), m),
        );
        let at_knee = points
            .iter()
            .find(|p| p.achieved < KEPT_UP * p.offered)
            .map_or("-", |p| bound_by(p, rtt).name());
        let kept_up = |r: &Row| r.point.achieved >= KEPT_UP * r.point.offered;
        let cost = rows
            .iter()
            .enumerate()
            .rfind(|(i, r)| kept_up(r) && baseline.is_some_and(|b| b.get(*i).is_some_and(kept_up)))
            .map(|(i, r)| {
                let base = baseline.map(|b| cpu_per_request(&b[i]));
                (
                    r.point.offered,
                    cpu_per_request(r),
                    base.map(|b| cpu_per_request(r) / b),
                )
            });
        knees.row(vec![
            name.clone(),
            format!("{most:.0}"),
            first,
            if rtt.is_zero() {
                "-".into()
            } else {
                format!("{:.3}", rtt.as_secs_f64() * 1000.0)
            },
            bound.map_or("-".into(), |b| format!("{b:.0}")),
            bound.map_or("-".into(), |b| format!("{:.2}", most / b)),
            at_knee.into(),
            cost.map_or("-".into(), |(rate, us, _)| {
                format!("{us:.1} (at {rate:.0}/s)")
            }),
            cost.and_then(|(_, _, x)| x)
                .map_or("-".into(), |x| format!("{x:.2}")),
        ]);
    }
    println!("{}\n", table.markdown());
    println!("{}", knees.markdown());
    table.write(&dir, "capacity")?;
    knees.write(&dir, "knees")?;

    let line = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        series
            .iter()
            .map(|(name, _, rows)| {
                (
                    name.clone(),
                    rows.iter()
                        .filter_map(|r| Some((r.point.offered, f(r)?)))
                        .collect(),
                )
            })
            .collect()
    };
    let charts = [
        Chart {
            title: "Throughput vs offered load (one instance)",
            x_label: "offered requests/s",
            y_label: "achieved requests/s",
            series: line(&|r| Some(r.point.achieved)),
            marks: Vec::new(),
        },
        Chart {
            title: "Check p99 vs offered load",
            x_label: "offered requests/s",
            y_label: "ms",
            series: line(&|r| r.check_p99.map(|s| s * 1000.0)),
            marks: Vec::new(),
        },
        Chart {
            title: "Request p99 vs offered load",
            x_label: "offered requests/s",
            y_label: "ms",
            series: line(&|r| r.req_p99.map(|us| us as f64 / 1000.0)),
            marks: Vec::new(),
        },
    ];
    for (file, chart) in ["throughput.png", "check-p99.png", "request-p99.png"]
        .iter()
        .zip(charts)
    {
        if let Some(path) = results::plot(&dir.join(file), std::slice::from_ref(&chart))? {
            println!("plot: {}", path.display());
        }
    }
    println!("results: {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(offered: f64, achieved: f64, latency_ms: f64, cpu: f64) -> Point {
        Point {
            offered,
            achieved,
            mean_latency: latency_ms / 1000.0,
            machine_cpu: cpu,
            // Offers turned away (slots full) when requests take 2 ms or
            // more; none when faster.
            turned_away: if latency_ms >= 2.0 { 0.2 } else { 0.0 },
        }
    }

    #[test]
    fn the_knee_is_the_first_offer_not_met_and_capacity_the_most_achieved() {
        let series = [
            p(1000.0, 1000.0, 1.0, 0.2),
            p(2000.0, 1990.0, 1.2, 0.4),
            p(4000.0, 3100.0, 2.5, 0.5),
            p(8000.0, 3050.0, 2.6, 0.5),
        ];
        assert_eq!(knee(&series), Some((4000.0, 3100.0)));
        assert_eq!(knee(&series[..2]), None, "kept up throughout");
    }

    #[test]
    fn the_round_trip_bound_is_in_flight_over_rtt() {
        assert_eq!(rtt_bound(8, Duration::from_millis(2)), Some(4000.0));
        assert_eq!(rtt_bound(8, Duration::from_micros(500)), Some(16000.0));
        assert_eq!(rtt_bound(8, Duration::ZERO), None);
    }

    #[test]
    fn each_point_names_what_bounds_it() {
        let rtt = Duration::from_millis(2);
        // Kept up.
        assert_eq!(bound_by(&p(1000.0, 990.0, 2.3, 0.3), rtt), Bound::Offered);
        // Slots full (offers turned away), most of each request the 2 ms
        // round trip.
        assert_eq!(
            bound_by(&p(4000.0, 3450.0, 2.3, 0.4), rtt),
            Bound::RoundTrip
        );
        // Slots full, requests much longer than the round trip: the CPU.
        assert_eq!(bound_by(&p(4000.0, 1000.0, 8.0, 0.9), rtt), Bound::Cpu);
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 2.7, 0.95), Duration::ZERO),
            Bound::Cpu
        );
        // Slots full, CPU not saturated, no round trip to blame.
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 2.7, 0.5), Duration::ZERO),
            Bound::InFlight
        );
        // No offer turned away and the CPU not busy, yet the offer not
        // met: the generator could not send it, not the instance's limit.
        assert_eq!(
            bound_by(&p(8000.0, 3000.0, 1.0, 0.5), Duration::ZERO),
            Bound::Generator
        );
        assert!((mean_in_flight(&p(4000.0, 3450.0, 2.3, 0.4)) - 7.935).abs() < 1e-9);
    }

    #[test]
    fn check_quantiles_come_from_the_histogram_between_two_scrapes() {
        let scrape = |a: u64, b: u64, c: u64| {
            format!(
                "# TYPE ratelimit_check_duration_seconds histogram\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"0.001\"}} {a}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"0.002\"}} {b}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"api\",source=\"redis\",le=\"+Inf\"}} {c}\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"0.001\"}} 1\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"0.002\"}} 1\n\
                 ratelimit_check_duration_seconds_bucket{{backend=\"lua\",policy=\"x\",source=\"local\",le=\"+Inf\"}} 1\n\
                 ratelimit_check_duration_seconds_count 5\n"
            )
        };
        let before = check_buckets(&scrape(10, 10, 10));
        assert_eq!(
            before,
            vec![(0.001, 11.0), (0.002, 11.0), (f64::INFINITY, 11.0)]
        );
        // 100 new checks: 50 under 1 ms, 50 between 1 and 2 ms.
        let after = check_buckets(&scrape(60, 110, 110));
        let p50 = quantile_between(&before, &after, 0.5).unwrap();
        assert!((p50 - 0.001).abs() < 1e-12, "{p50}");
        let p99 = quantile_between(&before, &after, 0.99).unwrap();
        assert!((p99 - 0.00198).abs() < 1e-9, "{p99}");
        assert_eq!(quantile_between(&before, &before, 0.5), None);
    }
}
