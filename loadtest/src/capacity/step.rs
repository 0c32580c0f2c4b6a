//! One step of the measurement: a fixed rate offered to one variant for a
//! few seconds (open loop, at most `--in-flight` outstanding), and what it
//! achieved, at what latency and CPU.

use super::model::{Point, check_buckets, quantile_between};
use crate::traffic::Latency;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// CPU time (seconds) of a process so far, from /proc.
fn process_cpu(pid: u32) -> Option<f64> {
    process_times(pid).map(|t| t.user + t.system)
}

/// A process's CPU time (seconds) in user space and in the kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuTimes {
    pub(crate) user: f64,
    pub(crate) system: f64,
}

/// A process's CPU time so far, from /proc.
pub(crate) fn process_times(pid: u32) -> Option<CpuTimes> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    let seconds = |i: usize| Some(fields.get(i)?.parse::<f64>().ok()? / 100.0); // USER_HZ
    Some(CpuTimes {
        user: seconds(11)?,
        system: seconds(12)?,
    })
}

/// CPU seconds used so far by the processes that share the machine in a
/// step: this load generator, the instance and redis-server. (The machine's
/// own /proc/stat counters are unreliable on a VM: a step with a busy
/// instance can read 0 %.)
fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&p| process_cpu(p)).sum()
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// The median of 200 PING round trips to `addr` (a Redis, or the proxy).
pub(super) async fn ping_rtt(addr: std::net::SocketAddr) -> anyhow::Result<Duration> {
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
pub(super) struct Variant {
    pub(super) name: String,
    /// The round trip added by the proxy (nominal).
    pub(super) rtt: Duration,
    pub(super) base: String,
    pub(super) path: &'static str,
    pub(super) pid: u32,
    /// Every process of the measurement: this one, the instance, Redis.
    pub(super) sharing: Vec<u32>,
}

/// One step's full row.
pub(super) struct Row {
    pub(super) point: Point,
    pub(super) req_p50: Option<u64>,
    pub(super) req_p99: Option<u64>,
    pub(super) check_p50: Option<f64>,
    pub(super) check_p99: Option<f64>,
    pub(super) instance_cores: f64,
    pub(super) errors: u64,
    /// This process's CPU time per request it sent, microseconds: the load
    /// generator's cost, and for the Lua variants also the latency proxy's,
    /// which runs in it.
    pub(super) generator_us: f64,
}

async fn scrape(http: &reqwest::Client, base: &str) -> Vec<(f64, f64)> {
    match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => check_buckets(&r.text().await.unwrap_or_default()),
        Err(_) => Vec::new(),
    }
}

/// Offers `rate` requests per second for `seconds`, at most `in_flight`
/// outstanding.
pub(super) async fn step(
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
    let own_before = process_cpu(std::process::id());
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
    let failed = errors.load(Ordering::Relaxed);
    let generator_us = match (own_before, process_cpu(std::process::id())) {
        (Some(a), Some(b)) if done + failed > 0 => (b - a) / (done + failed) as f64 * 1e6,
        _ => f64::NAN,
    };
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
        errors: failed,
        generator_us,
    }
}
