//! The load generator of `http-cost`: closed-loop HTTP/1.1 keep-alive
//! connections, each a thread with a minimal client of its own (no HTTP
//! library between the socket and the measurement), and the servers' CPU
//! read from `/proc` around the measured requests.

use super::HttpCostArgs;
use crate::capacity::{CpuTimes, process_times};
use anyhow::{Context, ensure};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Pins every thread of this process (and so every thread it starts
/// later, which inherits its creator's mask) to `cpu`.
pub(super) fn pin_this_process(cpu: usize) -> anyhow::Result<()> {
    use nix::sched::{CpuSet, sched_setaffinity};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(cpu)?;
    for task in std::fs::read_dir("/proc/self/task")? {
        let tid: i32 = task?.file_name().to_string_lossy().parse()?;
        sched_setaffinity(Pid::from_raw(tid), &set)
            .with_context(|| format!("cannot pin the load generator to CPU {cpu}"))?;
    }
    Ok(())
}

/// A minimal HTTP/1.1 keep-alive client: one request, its whole answer
/// (`Content-Length` bodies only, which every server here sends), its
/// status and its body's range in `buf`.
fn exchange(
    stream: &mut TcpStream,
    request: &[u8],
    buf: &mut Vec<u8>,
) -> anyhow::Result<(u16, std::ops::Range<usize>)> {
    stream.write_all(request)?;
    buf.clear();
    let mut read_more = |buf: &mut Vec<u8>| -> anyhow::Result<()> {
        let len = buf.len();
        buf.resize(len + 16 * 1024, 0);
        let n = stream.read(&mut buf[len..])?;
        buf.truncate(len + n);
        ensure!(n > 0, "the server closed the connection");
        Ok(())
    };
    let head_end = loop {
        read_more(buf)?;
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = std::str::from_utf8(&buf[..head_end])?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP answer: {head:?}"))?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .with_context(|| format!("no Content-Length: {head:?}"))?;
    while buf.len() < head_end + length {
        read_more(buf)?;
    }
    Ok((status, head_end..head_end + length))
}

/// What one connection saw.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) latencies_us: Vec<u32>,
    pub(super) ok: usize,
    pub(super) limited: usize,
    pub(super) other: usize,
}

/// Drives `port` with `args.connections` closed-loop connections: the
/// warm-up, then the measured requests, reading `pids`' CPU (user, kernel)
/// around them.
pub(super) fn drive(
    port: u16,
    pids: &[u32],
    args: &HttpCostArgs,
) -> anyhow::Result<(f64, Vec<CpuTimes>, Tally)> {
    let connections = args.connections.max(1);
    // Both barriers: every connection warmed up, then all start together.
    let warmed = Arc::new(Barrier::new(connections + 1));
    let start = Arc::new(Barrier::new(connections + 1));
    let request = b"GET /api/items HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let mut threads = Vec::new();
    for i in 0..connections {
        // The requests shared out, the first connections taking the rest.
        let share = |n: usize| n / connections + usize::from(i < n % connections);
        let (warmup, measured) = (share(args.warmup), share(args.requests));
        let (warmed, start) = (Arc::clone(&warmed), Arc::clone(&start));
        threads.push(std::thread::spawn(move || -> anyhow::Result<Tally> {
            let mut stream = TcpStream::connect(("127.0.0.1", port));
            if let Ok(s) = &stream {
                s.set_nodelay(true)?;
            }
            let mut buf = Vec::with_capacity(16 * 1024);
            let mut warm = || -> anyhow::Result<()> {
                let stream = stream.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
                for _ in 0..warmup {
                    exchange(stream, request, &mut buf)?;
                }
                Ok(())
            };
            let warm = warm();
            // Never leave the others waiting at a barrier.
            warmed.wait();
            start.wait();
            warm?;
            let stream = stream.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut tally = Tally {
                latencies_us: Vec::with_capacity(measured),
                ..Tally::default()
            };
            for _ in 0..measured {
                let sent = Instant::now();
                let (status, _) = exchange(stream, request, &mut buf)?;
                let us = sent.elapsed().as_micros();
                tally
                    .latencies_us
                    .push(u32::try_from(us).unwrap_or(u32::MAX));
                match status {
                    200 => tally.ok += 1,
                    429 => tally.limited += 1,
                    _ => tally.other += 1,
                }
            }
            Ok(tally)
        }));
    }
    warmed.wait();
    let cpu = || {
        pids.iter().map(|&p| {
            process_times(p).unwrap_or(CpuTimes {
                user: f64::NAN,
                system: f64::NAN,
            })
        })
    };
    let before: Vec<CpuTimes> = cpu().collect();
    let started = Instant::now();
    start.wait();
    let mut all = Tally::default();
    for t in threads {
        let tally = t
            .join()
            .map_err(|_| anyhow::anyhow!("a connection panicked"))??;
        all.latencies_us.extend(tally.latencies_us);
        all.ok += tally.ok;
        all.limited += tally.limited;
        all.other += tally.other;
    }
    let seconds = started.elapsed().as_secs_f64();
    let used = cpu()
        .zip(before)
        .map(|(after, b)| CpuTimes {
            user: after.user - b.user,
            system: after.system - b.system,
        })
        .collect();
    all.latencies_us.sort_unstable();
    Ok((seconds, used, all))
}

/// Decisions in the instance's `/metrics` that Redis did not make (the
/// failure mode's): the lua variant may have a handful on a loaded
/// machine (reported), no more, or it measured the fallback.
pub(super) fn fallback_decisions(port: u16) -> anyhow::Result<f64> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut buf = Vec::new();
    let (status, body) = exchange(
        &mut stream,
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        &mut buf,
    )?;
    ensure!(status == 200, "/metrics answered {status}");
    let text = std::str::from_utf8(&buf[body])?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("ratelimit_decisions_total{") && !l.contains("source=\"redis\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}
