//! One step of the measurement: a fixed rate offered to one variant for a
//! few seconds (open loop, at most `--in-flight` outstanding), and what it
//! achieved, at what latency and CPU.

use super::model::{Point, check_buckets, quantile_between};
use crate::http1;
use crate::traffic::Latency;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use std::time::{Duration, Instant};

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
    /// The instance's address.
    pub(super) addr: std::net::SocketAddr,
    /// The request each offer sends, whole.
    pub(super) request: Vec<u8>,
    pub(super) pid: u32,
    /// Every process of the measurement: this one, the instance, Redis.
    pub(super) sharing: Vec<u32>,
}

/// One step's full row.
pub(super) struct Row {
    pub(super) point: Point,
    /// How late the offers went out after their instants, p99, us.
    pub(super) late_p99: Option<u64>,
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

async fn scrape(http: &reqwest::Client, addr: std::net::SocketAddr) -> Vec<(f64, f64)> {
    match http.get(format!("http://{addr}/metrics")).send().await {
        Ok(r) => check_buckets(&r.text().await.unwrap_or_default()),
        Err(_) => Vec::new(),
    }
}

/// The in-flight slots: one keep-alive connection each, kept from step
/// to step (a step then measures requests, not connecting).
pub(super) type Slots = Vec<http1::Client>;

/// Offers `rate` requests per second for `seconds`, each on a free slot
/// (at most `slots.len()` outstanding).
pub(super) async fn step(
    http: &reqwest::Client,
    v: &Variant,
    slots: &mut Slots,
    rate: u64,
    seconds: f64,
) -> Row {
    let latency = Latency::default();
    // How late each offer went out after its instant: a generator that
    // falls behind sends late ticks at once, and a burst larger than the
    // free slots is turned away by the generator, not the server.
    let late = Latency::default();
    let (mut offers, mut turned_away, mut ok, mut errors, mut total_us) = (0u64, 0, 0, 0, 0);
    let before = scrape(http, v.addr).await;
    let cpu_before = cpu_of(&v.sharing);
    let proc_before = process_cpu(v.pid);
    let own_before = process_cpu(std::process::id());
    let start = Instant::now();
    let total = (seconds * rate as f64).ceil() as u64;
    // tokio's own timer ticks in milliseconds, so 8000 offers a second
    // would come as bursts of 8 or more, and a burst larger than the slots
    // would be turned away by the generator, not the server. The kernel's
    // timer (a timerfd) keeps each offer's instant, and being a descriptor
    // it wakes the same `epoll_wait` the answers do (a thread sleeping to
    // each instant would have to wake this one, a context switch or two an
    // offer). A tick late behind a busy moment comes at once, as its offer
    // would have.
    let mut ticks = tokio_osinterval::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    // Every request in flight is a future of this one task, which hands
    // offers to free slots and takes the answers: no task spawned, no
    // count shared between threads, per request.
    let mut busy = FuturesUnordered::new();
    let mut idle: Vec<&mut http1::Client> = slots.iter_mut().collect();
    let mut answered = |sent: Instant, good: bool| {
        let us = sent.elapsed().as_micros() as u64;
        if good {
            latency.record(us);
            total_us += us;
            ok += 1;
        } else {
            errors += 1;
        }
    };
    let mut offering = true;
    while offering || !busy.is_empty() {
        tokio::select! {
            // A slot freed first: an offer that arrives with it finds it.
            biased;
            Some((slot, sent, good)) = busy.next(), if !busy.is_empty() => {
                answered(sent, good);
                idle.push(slot);
            }
            due = ticks.tick(), if offering => {
                late.record(due.elapsed().as_micros() as u64);
                offers += 1;
                offering = offers < total;
                let Some(slot) = idle.pop() else {
                    turned_away += 1;
                    continue;
                };
                let request = &v.request;
                busy.push(async move {
                    let sent = Instant::now();
                    let answer = slot
                        .exchange(request, |status, _| (200..300).contains(&status))
                        .await;
                    (slot, sent, answer == Ok(true))
                });
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let after = scrape(http, v.addr).await;
    let machine = (cpu_of(&v.sharing) - cpu_before) / (elapsed * cores());
    let cores = match (proc_before, process_cpu(v.pid)) {
        (Some(a), Some(b)) => (b - a) / elapsed,
        _ => f64::NAN,
    };
    let generator_us = match (own_before, process_cpu(std::process::id())) {
        (Some(a), Some(b)) if ok + errors > 0 => (b - a) / (ok + errors) as f64 * 1e6,
        _ => f64::NAN,
    };
    Row {
        point: Point {
            offered: rate as f64,
            achieved: ok as f64 / elapsed,
            mean_latency: if ok == 0 {
                0.0
            } else {
                total_us as f64 / ok as f64 / 1e6
            },
            machine_cpu: machine,
            turned_away: turned_away as f64 / offers.max(1) as f64,
        },
        late_p99: late.quantile(0.99),
        req_p50: latency.quantile(0.5),
        req_p99: latency.quantile(0.99),
        check_p50: quantile_between(&before, &after, 0.5),
        check_p99: quantile_between(&before, &after, 0.99),
        instance_cores: cores,
        errors,
        generator_us,
    }
}
