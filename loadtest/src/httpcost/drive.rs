//! The load generator of `http-cost`: closed-loop HTTP/1.1 keep-alive
//! connections with a minimal client of their own (answers read by
//! [`crate::http1::parse`], no HTTP library between the socket and the
//! measurement), driven by one thread that never sleeps or by a thread
//! each asleep in `read` ([`Client`]), and the servers' CPU read from
//! `/proc` around the measured requests.

use super::HttpCostArgs;
use crate::capacity::{CpuTimes, process_times};
use anyhow::{Context, ensure};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
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
    loop {
        read_more(stream, buf)?;
        if let Some(answer) = answer(buf)? {
            return Ok(answer);
        }
    }
}

/// Reads what `stream` has onto the end of `buf`: `false` when a
/// non-blocking stream has nothing yet (and `buf` is as it was).
fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> anyhow::Result<bool> {
    let len = buf.len();
    buf.resize(len + 16 * 1024, 0);
    match stream.read(&mut buf[len..]) {
        Ok(n) => {
            buf.truncate(len + n);
            ensure!(n > 0, "the server closed the connection");
            Ok(true)
        }
        Err(e) => {
            buf.truncate(len);
            if e.kind() == std::io::ErrorKind::WouldBlock {
                Ok(false)
            } else {
                Err(e.into())
            }
        }
    }
}

/// The answer in `buf`, once it is all there: its status and its body's
/// range. `None` while more is to come. A chunked body is an error: every
/// server here sends a length, and the metrics text read from a body
/// ([`fallback_decisions`]) would include the chunks' framing.
fn answer(buf: &[u8]) -> anyhow::Result<Option<(u16, std::ops::Range<usize>)>> {
    let head = || String::from_utf8_lossy(&buf[..buf.len().min(200)]).into_owned();
    let answer = crate::http1::parse(buf, |status, _| status)
        .map_err(|why| anyhow::anyhow!("not an HTTP answer ({why}): {:?}", head()))?;
    match answer {
        Some(answer) if answer.chunked => anyhow::bail!("a chunked answer: {:?}", head()),
        answer => Ok(answer.map(|a| (a.read, a.body))),
    }
}

/// What one connection saw.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) latencies_us: Vec<u32>,
    pub(super) ok: usize,
    pub(super) limited: usize,
    pub(super) other: usize,
}

impl Tally {
    fn with_capacity(requests: usize) -> Self {
        Self {
            latencies_us: Vec::with_capacity(requests),
            ..Self::default()
        }
    }

    /// An answer with `status` to the request sent at `sent`.
    fn record(&mut self, sent: Instant, status: u16) {
        let us = sent.elapsed().as_micros();
        self.latencies_us
            .push(u32::try_from(us).unwrap_or(u32::MAX));
        match status {
            200 => self.ok += 1,
            429 => self.limited += 1,
            _ => self.other += 1,
        }
    }

    pub(super) fn add(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        self.ok += other.ok;
        self.limited += other.limited;
        self.other += other.other;
    }
}

/// How the load generator waits for an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Client {
    /// One thread polls every connection without ever sleeping
    /// (`epoll_wait` with a zero timeout). An answer finds nobody asleep
    /// on its socket, so the server's write wakes nothing.
    Spin,
    /// A thread per connection, asleep in `read` until its answer comes:
    /// the server's write wakes it, and over loopback the server pays for
    /// that wake-up (on a VM, often an interrupt to an idle CPU), more the
    /// more often the load generator is idle, that is the slower the
    /// server (docs/performance.md, "Redis checks over HTTP").
    Threads,
}

/// The request every connection sends, framed once.
static REQUEST: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let mut request = Vec::new();
    let fields = [("host", "127.0.0.1")];
    crate::http1::write_request(&mut request, "GET", "/api/items", fields, None);
    request
});

/// Drives `port` with `args.connections` closed-loop connections: the
/// warm-up, then the measured requests, reading `pids`' CPU (user, kernel)
/// around them.
pub(super) fn drive(
    port: u16,
    pids: &[u32],
    args: &HttpCostArgs,
) -> anyhow::Result<(f64, Vec<CpuTimes>, Tally)> {
    let connections = args.connections.max(1);
    let shares = (0..connections).map(|i| {
        (
            share(i, args.warmup, connections),
            share(i, args.requests, connections),
        )
    });
    let cpu = || cpu_times(pids);
    let (before, started, mut all) = match args.client {
        Client::Spin => spin(port, shares.collect(), cpu)?,
        Client::Threads => threads(port, shares.collect(), cpu)?,
    };
    let seconds = started.elapsed().as_secs_f64();
    let used = cpu_since(pids, before);
    all.latencies_us.sort_unstable();
    Ok((seconds, used, all))
}

/// Connection `i`'s part of `n` requests over `connections`: shared out
/// evenly, the first connections taking the rest.
pub(super) fn share(i: usize, n: usize, connections: usize) -> usize {
    n / connections + usize::from(i < n % connections)
}

/// `pids`' CPU times now (NaN for a process that cannot be read).
pub(super) fn cpu_times(pids: &[u32]) -> Vec<CpuTimes> {
    pids.iter()
        .map(|&p| {
            process_times(p).unwrap_or(CpuTimes {
                user: f64::NAN,
                system: f64::NAN,
            })
        })
        .collect()
}

/// The CPU `pids` used since `before` ([`cpu_times`] of the same pids).
pub(super) fn cpu_since(pids: &[u32], before: Vec<CpuTimes>) -> Vec<CpuTimes> {
    cpu_times(pids)
        .into_iter()
        .zip(before)
        .map(|(after, b)| CpuTimes {
            user: after.user - b.user,
            system: after.system - b.system,
        })
        .collect()
}

/// A connection of the spinning client.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// When the request in flight was sent.
    sent: Instant,
    /// Requests still to send in this phase, the one in flight included.
    left: usize,
}

/// How long the spinning client waits for any answer before it gives up:
/// a server that stopped answering ends the run with an error.
const STALL: std::time::Duration = std::time::Duration::from_secs(30);

/// [`Client::Spin`]: every connection from this thread, the warm-up
/// shares then (with `cpu` read between) the measured ones.
fn spin(
    port: u16,
    shares: Vec<(usize, usize)>,
    cpu: impl Fn() -> Vec<CpuTimes>,
) -> anyhow::Result<(Vec<CpuTimes>, Instant, Tally)> {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
    let mut conns = Vec::with_capacity(shares.len());
    for i in 0..shares.len() {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        epoll.add(&stream, EpollEvent::new(EpollFlags::EPOLLIN, i as u64))?;
        conns.push(Conn {
            stream,
            buf: Vec::with_capacity(16 * 1024),
            sent: Instant::now(),
            left: 0,
        });
    }
    phase(&epoll, &mut conns, shares.iter().map(|s| s.0), None)?;
    let mut tally = Tally::with_capacity(shares.iter().map(|s| s.1).sum());
    let before = cpu();
    let started = Instant::now();
    phase(
        &epoll,
        &mut conns,
        shares.iter().map(|s| s.1),
        Some(&mut tally),
    )?;
    Ok((before, started, tally))
}

/// One phase of the spinning client: each connection sends its share,
/// one request at a time, the answers counted in `tally` if there is one.
fn phase(
    epoll: &Epoll,
    conns: &mut [Conn],
    shares: impl Iterator<Item = usize>,
    mut tally: Option<&mut Tally>,
) -> anyhow::Result<()> {
    let mut active = 0;
    for (conn, share) in conns.iter_mut().zip(shares) {
        conn.left = share;
        if share > 0 {
            active += 1;
            conn.sent = Instant::now();
            send(&mut conn.stream)?;
        }
    }
    let mut events = vec![EpollEvent::empty(); conns.len()];
    let mut last_answer = Instant::now();
    while active > 0 {
        let ready = epoll.wait(&mut events, EpollTimeout::ZERO)?;
        if ready == 0 {
            ensure!(
                last_answer.elapsed() < STALL,
                "no answer from the server in {STALL:?}"
            );
            continue;
        }
        for event in &events[..ready] {
            let conn = &mut conns[event.data() as usize];
            let Some((status, _)) = read_answer(conn)? else {
                continue;
            };
            last_answer = Instant::now();
            if let Some(tally) = tally.as_deref_mut() {
                tally.record(conn.sent, status);
            }
            conn.buf.clear();
            ensure!(conn.left > 0, "an answer nobody asked for");
            conn.left -= 1;
            if conn.left == 0 {
                active -= 1;
            } else {
                conn.sent = Instant::now();
                send(&mut conn.stream)?;
            }
        }
    }
    Ok(())
}

/// Sends the request on a non-blocking connection with nothing else in
/// flight: its few bytes fit the socket's buffer, or something is wrong.
fn send(stream: &mut TcpStream) -> anyhow::Result<()> {
    let n = stream.write(&REQUEST).context("cannot send the request")?;
    ensure!(n == REQUEST.len(), "the request went out in part");
    Ok(())
}

/// Reads what `conn`'s socket has; its answer once all of it is there.
fn read_answer(conn: &mut Conn) -> anyhow::Result<Option<(u16, std::ops::Range<usize>)>> {
    while read_more(&mut conn.stream, &mut conn.buf)? {
        if let Some(answer) = answer(&conn.buf)? {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}

/// [`Client::Threads`]: a thread per connection, each its warm-up share,
/// then (all warmed up, `cpu` read) its measured one.
fn threads(
    port: u16,
    shares: Vec<(usize, usize)>,
    cpu: impl Fn() -> Vec<CpuTimes>,
) -> anyhow::Result<(Vec<CpuTimes>, Instant, Tally)> {
    // Both barriers: every connection warmed up, then all start together.
    let warmed = Arc::new(Barrier::new(shares.len() + 1));
    let start = Arc::new(Barrier::new(shares.len() + 1));
    let mut threads = Vec::new();
    for (warmup, measured) in shares {
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
                    exchange(stream, &REQUEST, &mut buf)?;
                }
                Ok(())
            };
            let warm = warm();
            // Never leave the others waiting at a barrier.
            warmed.wait();
            start.wait();
            warm?;
            let stream = stream.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut tally = Tally::with_capacity(measured);
            for _ in 0..measured {
                let sent = Instant::now();
                let (status, _) = exchange(stream, &REQUEST, &mut buf)?;
                tally.record(sent, status);
            }
            Ok(tally)
        }));
    }
    warmed.wait();
    let before = cpu();
    let started = Instant::now();
    start.wait();
    let mut all = Tally::default();
    for t in threads {
        all.add(
            t.join()
                .map_err(|_| anyhow::anyhow!("a connection panicked"))??,
        );
    }
    Ok((before, started, all))
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

#[cfg(test)]
mod tests {
    use super::{Conn, answer, read_answer};
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    const HEAD: &[u8] =
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 5\r\nretry-after: 1\r\n\r\n";

    #[test]
    fn an_answer_is_taken_only_once_all_of_it_is_there() {
        let whole = [HEAD, b"hello"].concat();
        for cut in 0..whole.len() {
            assert_eq!(answer(&whole[..cut]).unwrap(), None, "cut at {cut}");
        }
        let body = HEAD.len()..whole.len();
        assert_eq!(answer(&whole).unwrap(), Some((429, body)));
    }

    #[test]
    fn what_is_not_an_answer_with_a_length_is_an_error() {
        assert!(answer(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(answer(b"HTTP/1.1 200 OK\r\nserver: x\r\n\r\n").is_err());
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n";
        assert!(answer(chunked).is_err());
    }

    /// Reads `conn` until `done` says so, each read's result checked by it;
    /// bounded, so a test that waits for bytes that never come fails.
    fn read_until(
        conn: &mut Conn,
        mut done: impl FnMut(&Conn, Option<(u16, std::ops::Range<usize>)>) -> bool,
    ) {
        let start = Instant::now();
        loop {
            let got = read_answer(conn).unwrap();
            if done(conn, got) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the bytes never came"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn the_spinning_client_puts_an_answer_split_across_reads_together() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        stream.set_nonblocking(true).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let mut conn = Conn {
            stream,
            buf: Vec::new(),
            sent: Instant::now(),
            left: 1,
        };
        assert_eq!(read_answer(&mut conn).unwrap(), None, "nothing sent yet");
        assert!(
            conn.buf.is_empty(),
            "a read that found nothing keeps nothing"
        );
        server.write_all(&HEAD[..20]).unwrap();
        read_until(&mut conn, |c, got| {
            assert_eq!(got, None, "part of the head");
            c.buf.len() == 20
        });
        server.write_all(&HEAD[20..]).unwrap();
        server.write_all(b"hel").unwrap();
        read_until(&mut conn, |c, got| {
            assert_eq!(got, None, "the head and part of the body");
            c.buf.len() == HEAD.len() + 3
        });
        server.write_all(b"lo").unwrap();
        let body = HEAD.len()..HEAD.len() + 5;
        read_until(&mut conn, |_, got| {
            got.is_some_and(|a| {
                assert_eq!(a, (429, body.clone()));
                true
            })
        });
        drop(server);
        conn.buf.clear();
        let start = Instant::now();
        let closed = loop {
            match read_answer(&mut conn) {
                Err(e) => break e.to_string(),
                Ok(got) => assert_eq!(got, None),
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the close never came"
            );
        };
        assert!(closed.contains("closed the connection"), "{closed}");
    }
}
