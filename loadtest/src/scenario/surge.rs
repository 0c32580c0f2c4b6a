//! The `hotkey` surge's own client. The surge is nearly every request of
//! a run (8,000 a second against the others' few hundred), and goose spends
//! about 60 µs of CPU on each (runbooks/hot-key.md): on 2 cores the load
//! generator, not the system under test, would be what saturates. So the
//! surge goes out over plain HTTP/1.1 keep-alive connections, one task
//! each, paced by the run's one schedule, each answer checked and counted
//! as goose's users count theirs; goose drives the healthy classes.
//!
//! The client is the few lines of HTTP/1.1 the surge needs, as wrk's is: a
//! request written from one buffer, the answer's head parsed in place by
//! `httparse` and its body skipped (a `Content-Length` or chunked body),
//! with no connection task, channel, header map or body stream of a
//! general client between the socket and the check (docs/load.md has
//! what each cost). The connections share one thread and its own
//! single-threaded runtime: an answer then wakes the thread already
//! polling, never a second one.

use super::{Class, Phase, Run, next_request, record};
use crate::traffic::{self, Verdict};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

/// How long one answer may take, as goose's client allows.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The surge, running on its thread until [`Surging::stop`].
pub(super) struct Surging {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Surging {
    /// Starts `connections` surge clients against `target` (`host` is the
    /// Host header).
    pub(super) fn start(
        run: Arc<Run>,
        target: SocketAddr,
        host: String,
        connections: u64,
    ) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("surge".into())
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        () = drive(run, target, host, connections) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Self { stop, thread })
    }

    /// Stops every client (those waiting on an answer drop it) and waits
    /// for the thread.
    pub(super) fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// Runs `connections` surge clients against `target` (`host` is the
/// Host header).
async fn drive(run: Arc<Run>, target: SocketAddr, host: String, connections: u64) {
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let n = run
            .next_address
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        clients.spawn(client(Arc::clone(&run), target, host.clone(), n));
    }
    while clients.join_next().await.is_some() {}
}

/// One surge client: its address (as its cause says), one connection at a
/// time, a request in each of its slots while the surge is on.
async fn client(run: Arc<Run>, target: SocketAddr, host: String, n: u64) {
    let Some(surge) = run.surge.clone() else {
        return;
    };
    let who = traffic::SurgeClient::of(surge.cause);
    let local = run.bind.then(|| who.address(n));
    let forwarded_for =
        (surge.cause == super::Cause::Proxy).then(|| traffic::client_address(n).to_string());
    let mut rng = SmallRng::seed_from_u64(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut open: Option<Connection> = None;
    let mut request = Vec::with_capacity(256);
    loop {
        if !matches!(
            run.phase(run.start.elapsed()),
            Phase::During | Phase::Mitigated
        ) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        if let Some(pacer) = &run.pacer {
            let now = Instant::now();
            let slot = pacer.slot(now);
            if slot > now {
                tokio::time::sleep_until(slot.into()).await;
            }
        }
        // A slot past the window's end sends nothing.
        let phase = run.phase(run.start.elapsed());
        if !matches!(phase, Phase::During | Phase::Mitigated) {
            continue;
        }
        let (route, key) = next_request(&run, Class::Surge, &mut rng);
        request.clear();
        let body = route.body();
        let _ = write!(
            request,
            "{} {} HTTP/1.1\r\nhost: {host}\r\nuser-agent: {}\r\n",
            if body.is_some() { "POST" } else { "GET" },
            route.path(),
            who.user_agent
        );
        if let Some(tenant) = key {
            let _ = write!(request, "x-api-key: {}\r\n", tenant.key);
        }
        if let Some(addr) = &forwarded_for {
            let _ = write!(request, "x-forwarded-for: {addr}\r\n");
        }
        match &body {
            Some(json) => {
                let _ = write!(
                    request,
                    "content-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
                    json.len()
                );
            }
            None => request.extend_from_slice(b"\r\n"),
        }
        let sent = Instant::now();
        let verdict =
            match tokio::time::timeout(TIMEOUT, exchange(&mut open, target, local, &request)).await
            {
                Ok(Ok(verdict)) => verdict,
                Ok(Err(why)) => {
                    open = None;
                    Verdict::Unavailable(format!("transport: {why}"))
                }
                Err(_) => {
                    open = None;
                    Verdict::Unavailable("transport: timeout".into())
                }
            };
        record(
            &run,
            Class::Surge,
            phase,
            sent.elapsed().as_micros() as u64,
            &verdict,
        );
    }
}

/// A keep-alive connection and the bytes read from it not yet used.
struct Connection {
    stream: TcpStream,
    read: Vec<u8>,
}

/// One request on the client's connection (opened first if it has none)
/// and its answer, read whole and checked; the connection is closed when
/// the server says so.
async fn exchange(
    open: &mut Option<Connection>,
    target: SocketAddr,
    local: Option<IpAddr>,
    request: &[u8],
) -> Result<Verdict, &'static str> {
    if open.is_none() {
        *open = Some(Connection {
            stream: connect(target, local).await?,
            read: Vec::with_capacity(4096),
        });
    }
    let Some(connection) = open.as_mut() else {
        return Err("connect");
    };
    connection
        .stream
        .write_all(request)
        .await
        .map_err(|_| "request")?;
    let answer = connection.answer().await?;
    if answer.close {
        *open = None;
    }
    Ok(answer.verdict)
}

/// An answer, read.
#[derive(Debug)]
struct Answer {
    verdict: Verdict,
    /// The server closes the connection after it.
    close: bool,
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Length(usize),
    Chunked,
}

/// Response headers as [`traffic::check`] reads them (names are case
/// insensitive; a value that is no UTF-8 is absent).
struct Fields<'a>(&'a [httparse::Header<'a>]);

impl traffic::Headers for Fields<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
    }
}

/// The most header fields an answer may carry.
const MAX_FIELDS: usize = 32;

/// What a complete head says: its length, the verdict on it, how its body
/// ends and whether the connection closes. `None` while it is partial.
fn head(bytes: &[u8]) -> Result<Option<(usize, Answer, Body)>, &'static str> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut response = httparse::Response::new(&mut fields);
    let length = match response.parse(bytes) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err("response"),
    };
    let status = response.code.ok_or("response")?;
    let fields = Fields(response.headers);
    let field = |name| traffic::Headers::get(&fields, name).map(str::trim);
    let body = if field("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        Body::Chunked
    } else {
        match field("content-length") {
            Some(n) => Body::Length(n.parse().map_err(|_| "response")?),
            // A 1xx, 204 or 304 has none; anything else would end with the
            // connection, which keep-alive cannot tell apart: refused.
            None if status == 204 || status == 304 || status < 200 => Body::Length(0),
            None => return Err("response"),
        }
    };
    let close = field("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
    let verdict = traffic::check(status, &fields);
    Ok(Some((length, Answer { verdict, close }, body)))
}

/// Where a chunked body that starts at `bytes[0]` ends (past its last
/// chunk and an empty trailer), `None` while it is partial.
fn chunked_end(bytes: &[u8]) -> Result<Option<usize>, &'static str> {
    let mut at = 0;
    loop {
        let (line, size) = match httparse::parse_chunk_size(&bytes[at..]) {
            Ok(httparse::Status::Complete(chunk)) => chunk,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(_) => return Err("body"),
        };
        let size = usize::try_from(size).map_err(|_| "body")?;
        at += line;
        if size == 0 {
            // No trailer fields from our servers: the body ends at the
            // empty line after the last chunk.
            return Ok((bytes.len() >= at + 2).then_some(at + 2));
        }
        // The chunk's data and its CRLF.
        let next = at
            .checked_add(size)
            .and_then(|n| n.checked_add(2))
            .ok_or("body")?;
        if bytes.len() < next {
            return Ok(None);
        }
        at = next;
    }
}

impl Connection {
    /// Reads one answer: its head, then its body, which is skipped.
    async fn answer(&mut self) -> Result<Answer, &'static str> {
        let (length, answer, body) = loop {
            if let Some(head) = head(&self.read)? {
                break head;
            }
            self.fill().await?;
        };
        let end = loop {
            let rest = &self.read[length..];
            let end = match body {
                Body::Length(n) => (rest.len() >= n).then_some(n),
                Body::Chunked => chunked_end(rest)?,
            };
            if let Some(end) = end {
                break length + end;
            }
            self.fill().await?;
        };
        // Whatever follows belongs to the next answer (none is sent before
        // its request, but a server may say more than it was asked).
        self.read.drain(..end);
        if self.read.is_empty() {
            // The socket is read dry: say so, or the next answer's first
            // read would be a system call that finds nothing yet (one a
            // request, most of them on this path). A close or an answer
            // that arrives later is a new edge, and wakes the read again.
            let _ = self.stream.try_io(Interest::READABLE, || {
                Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
            });
        }
        Ok(answer)
    }

    /// Reads more from the connection; the end of it is an error.
    async fn fill(&mut self) -> Result<(), &'static str> {
        if self.read.len() > 1 << 20 {
            return Err("response");
        }
        match self.stream.read_buf(&mut self.read).await {
            Ok(0) | Err(_) => Err("closed"),
            Ok(_) => Ok(()),
        }
    }
}

/// A connection to `target`, from `local` if given.
async fn connect(target: SocketAddr, local: Option<IpAddr>) -> Result<TcpStream, &'static str> {
    let socket = match target {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(|_| "connect")?;
    if let Some(ip) = local {
        socket.bind(SocketAddr::new(ip, 0)).map_err(|_| "connect")?;
    }
    let stream = socket.connect(target).await.map_err(|_| "connect")?;
    stream.set_nodelay(true).map_err(|_| "connect")?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIELDS: &str = "ratelimit-limit: 5\r\nratelimit-remaining: 4\r\nratelimit-reset: 1\r\n\
        ratelimit-policy: \"p\";q=5;w=1\r\nratelimit: \"p\";r=4;t=0\r\n";

    fn answer(head: &str) -> String {
        format!("HTTP/1.1 200 OK\r\n{FIELDS}{head}\r\n")
    }

    #[test]
    fn a_head_says_its_length_verdict_and_body() {
        let text = answer("content-length: 2\r\n") + "[]";
        let (length, said, body) = head(text.as_bytes()).unwrap().unwrap();
        assert_eq!(length, text.len() - 2);
        assert_eq!(said.verdict, Verdict::Admitted);
        assert!(!said.close);
        assert_eq!(body, Body::Length(2));
        // Every byte short of the end of the head is a partial head.
        for cut in 0..length {
            assert!(head(&text.as_bytes()[..cut]).unwrap().is_none(), "{cut}");
        }
    }

    #[test]
    fn a_head_is_checked_as_goose_checks_it() {
        let missing = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let (_, said, _) = head(missing.as_bytes()).unwrap().unwrap();
        assert!(matches!(said.verdict, Verdict::Broken(_)), "{said:?}");
        let limited = format!(
            "HTTP/1.1 429 Too Many Requests\r\n{FIELDS}retry-after: 1\r\ncontent-length: 0\r\n\r\n"
        );
        let (_, said, _) = head(limited.as_bytes()).unwrap().unwrap();
        assert_eq!(said.verdict, Verdict::Throttled);
        let down =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let (_, said, _) = head(down.as_bytes()).unwrap().unwrap();
        assert!(matches!(said.verdict, Verdict::Unavailable(_)));
        assert!(said.close);
    }

    #[test]
    fn a_body_without_a_length_is_refused() {
        assert!(head(answer("").as_bytes()).is_err());
        let empty = "HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(head(empty.as_bytes()).unwrap().unwrap().2, Body::Length(0));
        assert!(head(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n").is_err());
        assert!(head(b"nonsense\r\n\r\n").is_err());
    }

    #[test]
    fn a_chunked_body_ends_after_its_last_chunk() {
        let text = answer("transfer-encoding: chunked\r\n");
        assert_eq!(head(text.as_bytes()).unwrap().unwrap().2, Body::Chunked);
        let body = b"2\r\n[]\r\n10\r\n0123456789abcdef\r\n0\r\n\r\nnext";
        let end = body.len() - 4;
        assert_eq!(chunked_end(body).unwrap(), Some(end));
        for cut in 0..end {
            assert_eq!(chunked_end(&body[..cut]).unwrap(), None, "{cut}");
        }
        assert!(chunked_end(b"zz\r\n").is_err());
    }
}
