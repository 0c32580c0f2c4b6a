//! Slow and idle connections, on real sockets against the real binary: the
//! header timeout, the request deadline, the connection caps and 413 before
//! the body. The instance runs as its own process so
//! that its descriptors can be counted in `/proc/<pid>/fd`.
//!
//! Timings here are bounds with wide margins (a busy 2-core machine), never
//! measurements: a socket the server should close "within the timeout" is
//! allowed the timeout plus several seconds; one that must not wait for a
//! slot must be served in well under the timeout that would free one.

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use testkit::{ChildGuard, free_port, wait_for_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

/// The header timeout of the instances here: long enough that a request on
/// a busy machine is never cut, short enough for a test.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// Their request deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Their caps.
const MAX_CONNECTIONS: usize = 16;
const PER_ADDRESS: usize = 8;

struct Instance {
    port: u16,
    proc: ChildGuard,
}

impl Instance {
    fn start() -> Self {
        // Tests start instances at once, each on a port found free a moment
        // before: two can pick the same one, and then one instance exits
        // and its test would talk to the other's (whose caps another test
        // fills). So a test uses the port only once its own instance is
        // seen to hold it.
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..5 {
            let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let id = format!("conn-test-{}-{n}", std::process::id());
            let port = free_port().unwrap();
            let child = Command::new(BIN)
                .args(["--backend", "memory", "--instance-id", &id])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args([
                    "--http-header-timeout",
                    "2s",
                    "--http-request-timeout",
                    "2s",
                ])
                .args(["--http-max-connections", &MAX_CONNECTIONS.to_string()])
                .args([
                    "--http-max-connections-per-address",
                    &PER_ADDRESS.to_string(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut proc = ChildGuard(child);
            wait_for_port(port, "ratelimiter").unwrap();
            // An instance that could not bind exits at once ("address in
            // use"); one still running a second later holds the port.
            let started = std::time::Instant::now();
            let mut exited = false;
            while started.elapsed() < Duration::from_secs(1) && !exited {
                exited = proc.0.try_wait().unwrap().is_some();
                std::thread::sleep(Duration::from_millis(20));
            }
            if !exited {
                return Self { port, proc };
            }
        }
        panic!("no port of its own after 5 tries");
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Descriptors the instance holds now.
    fn descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.proc.pid()))
            .unwrap()
            .count()
    }

    /// A connection from `source` (a loopback address of its own, so that
    /// it is another client to the per-address cap).
    async fn connect_from(&self, source: [u8; 4]) -> TcpStream {
        let socket = TcpSocket::new_v4().unwrap();
        socket
            .bind(SocketAddr::from((IpAddr::from(source), 0)))
            .unwrap();
        socket.connect(self.addr()).await.unwrap()
    }

    /// `/metrics`, asked from 127.0.0.3 (not a slow client's address).
    async fn metrics(&self) -> String {
        let http = client_from([127, 0, 0, 3]);
        http.get(format!("http://{}/metrics", self.addr()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

fn client_from(source: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(IpAddr::from(source))
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// The value of `name{labels}` in Prometheus text (0 if absent).
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until the peer closes `stream` (EOF or reset), reading and
/// keeping whatever it sent first; `None` if it is still open at `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<(Duration, String)> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = limit.checked_sub(start.elapsed())?;
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Some((start.elapsed(), String::from_utf8_lossy(&got).into_owned()));
            }
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// More slow clients from one host than the whole cap: a partial request
/// head, then one more byte every 300 ms (a trickle that never finishes).
/// The host gets its share of the cap, the rest are closed on arrival and
/// counted; the admitted ones are closed by the header timeout however
/// they trickle; another client is served at once all along; and the
/// instance's descriptors never exceed the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_beyond_the_cap_are_refused_and_timed_out_while_others_are_served() {
    let instance = Instance::start();
    let before = instance.descriptors();
    let refused_before = metric(
        &instance.metrics().await,
        "http_server_connections_refused_total{reason=\"max_connections_per_address\"}",
    );

    const SLOW: usize = 40;
    let mut slow = Vec::new();
    for _ in 0..SLOW {
        let mut stream = instance.connect_from([127, 0, 0, 1]).await;
        // The server may have closed it already: writes may fail.
        let _ = stream
            .write_all(b"GET /api/items HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await;
        let limit = HEADER_TIMEOUT + Duration::from_secs(6);
        slow.push(tokio::spawn(async move {
            let start = Instant::now();
            let (mut read, mut write) = stream.into_split();
            let trickle = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if write.write_all(b"a").await.is_err() {
                        return;
                    }
                }
            });
            let mut buf = [0u8; 1024];
            let closed = loop {
                match tokio::time::timeout(
                    limit.saturating_sub(start.elapsed()),
                    read.read(&mut buf),
                )
                .await
                {
                    Err(_) => break None,
                    Ok(Ok(0) | Err(_)) => break Some(start.elapsed()),
                    Ok(Ok(_)) => {}
                }
            };
            trickle.abort();
            closed
        }));
    }

    // Meanwhile another client (its own address) is served, promptly.
    let http = client_from([127, 0, 0, 2]);
    let mut peak = instance.descriptors();
    for _ in 0..20 {
        let start = Instant::now();
        let response = http
            .get(format!("http://{}/api/items", instance.addr()))
            .send()
            .await
            .expect("another client is not refused");
        assert_eq!(response.status(), 200);
        assert!(
            start.elapsed() < HEADER_TIMEOUT / 2,
            "served in {:?}: it waited for a slot",
            start.elapsed()
        );
        peak = peak.max(instance.descriptors());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut closed = Vec::new();
    for task in slow {
        closed.push(task.await.unwrap());
    }
    let open_still = closed.iter().filter(|c| c.is_none()).count();
    assert_eq!(
        open_still,
        0,
        "slow connections still open {:?} after they began",
        HEADER_TIMEOUT + Duration::from_secs(6)
    );
    // The admitted ones were held until the header timeout, not before
    // (they trickled all along): the timer closed them, not the cap.
    let timed_out = closed
        .iter()
        .flatten()
        .filter(|t| **t >= HEADER_TIMEOUT / 2)
        .count();
    assert!(
        (1..=PER_ADDRESS).contains(&timed_out),
        "{timed_out} slow connections lasted past half the header timeout; at most {PER_ADDRESS} may be admitted"
    );
    assert!(
        peak <= before + MAX_CONNECTIONS,
        "descriptors went from {before} to {peak} (cap {MAX_CONNECTIONS})"
    );

    // A connection's timeout is counted as its task ends, which can be a
    // moment after the client saw it closed: scrape until it is in.
    let mut text = instance.metrics().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&text, "http_server_header_timeouts_total") < timed_out as f64
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        text = instance.metrics().await;
    }
    let refused = metric(
        &text,
        "http_server_connections_refused_total{reason=\"max_connections_per_address\"}",
    ) - refused_before;
    assert!(
        refused >= (SLOW - PER_ADDRESS) as f64,
        "{refused} refusals counted for {SLOW} connections with room for {PER_ADDRESS}"
    );
    assert!(
        metric(&text, "http_server_header_timeouts_total") >= timed_out as f64,
        "{text}"
    );
    // And every descriptor came back (the metrics client's own pooled
    // connection may still be open).
    let deadline = Instant::now() + Duration::from_secs(5);
    while instance.descriptors() > before + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(instance.descriptors() <= before + 1);
}

/// The whole cap is shared too: with the per-address cap at the total,
/// clients from many addresses fill it and the next one is closed on
/// arrival, counted as `max_connections`; a slot freed is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_total_cap_closes_the_connection_over_it_at_once() {
    let instance = Instance::start();
    let idle = instance.descriptors();
    let refused_before = metric(
        &instance.metrics().await,
        "http_server_connections_refused_total{reason=\"max_connections\"}",
    );
    // Until the server has seen that scrape's connection go (it would take
    // a slot); then sixteen idle connections from two addresses, eight
    // each, and until the server has accepted them all (on a loaded
    // machine that takes a while; the next must find the cap full).
    let settle = |want: usize| {
        let instance = &instance;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while instance.descriptors() != want && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(instance.descriptors(), want);
        }
    };
    settle(idle).await;
    let mut held = Vec::new();
    for i in 0..MAX_CONNECTIONS {
        let source = [127, 0, 1, 1 + (i / PER_ADDRESS) as u8];
        held.push(instance.connect_from(source).await);
    }
    settle(idle + MAX_CONNECTIONS).await;
    let mut over = instance.connect_from([127, 0, 1, 9]).await;
    let closed = closed_within(&mut over, HEADER_TIMEOUT / 2).await;
    assert!(
        closed.is_some(),
        "the connection over the cap was not closed at once"
    );
    // A slot freed is a slot taken.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut next = instance.connect_from([127, 0, 1, 9]).await;
    next.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (_, answer) = closed_within(&mut next, HEADER_TIMEOUT / 2)
        .await
        .expect("answered and closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = metric(
        &instance.metrics().await,
        "http_server_connections_refused_total{reason=\"max_connections\"}",
    ) - refused_before;
    assert!(refused >= 1.0, "the refusal was not counted");
}

/// An idle keep-alive connection is closed by the header timeout: hyper's
/// clock starts again once a response is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout() {
    let instance = Instance::start();
    let mut stream = instance.connect_from([127, 0, 0, 1]).await;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // "ok\n", keep-alive: read the answer, then wait.
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !got.ends_with(b"ok\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("answered")
            .unwrap();
        assert!(n > 0, "closed before answering");
        got.extend_from_slice(&buf[..n]);
    }
    let (after, rest) = closed_within(&mut stream, HEADER_TIMEOUT + Duration::from_secs(6))
        .await
        .expect("an idle connection was still open");
    assert!(rest.is_empty(), "{rest}");
    assert!(
        after >= HEADER_TIMEOUT / 2,
        "closed after {after:?}: not kept alive at all"
    );
}

/// A body that stalls is answered 408 problem+json by the request
/// deadline, and the connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_is_answered_408_and_its_connection_closed() {
    let instance = Instance::start();
    let mut stream = instance.connect_from([127, 0, 0, 1]).await;
    stream
        .write_all(
            b"POST /api/orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"item_id\":",
        )
        .await
        .unwrap();
    let (after, answer) = closed_within(&mut stream, REQUEST_TIMEOUT + Duration::from_secs(6))
        .await
        .expect("a stalled body was waited for");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("application/problem+json") && answer.contains("/problems/request-timeout"),
        "{answer}"
    );
    assert!(after >= REQUEST_TIMEOUT / 2, "408 after only {after:?}");
    let text = instance.metrics().await;
    assert_eq!(
        metric(
            &text,
            "http_server_request_duration_seconds_count{http_request_method=\"POST\",http_route=\"/api/orders\",http_response_status_code=\"408\"}"
        ),
        1.0,
        "{text}"
    );
}

/// A declared length over the body limit is refused at once, before any of
/// the body is sent, and the connection closed; a body within it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_length_over_the_limit_is_refused_before_the_body() {
    let instance = Instance::start();
    let mut stream = instance.connect_from([127, 0, 0, 1]).await;
    stream
        .write_all(
            b"POST /api/orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n",
        )
        .await
        .unwrap();
    let (_, answer) = closed_within(&mut stream, REQUEST_TIMEOUT / 2)
        .await
        .expect("not refused at once: the body was waited for");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("/problems/too-large"), "{answer}");
    // Counted under its route, and before the limiter: no check was made.
    let text = instance.metrics().await;
    assert_eq!(
        metric(
            &text,
            "http_server_request_duration_seconds_count{http_request_method=\"POST\",http_route=\"/api/orders\",http_response_status_code=\"413\"}"
        ),
        1.0,
        "{text}"
    );
    assert!(
        !text.contains("ratelimit_decisions_total{"),
        "the limiter decided on a body it could never take: {text}"
    );

    let response = client_from([127, 0, 0, 1])
        .post(format!("http://{}/api/orders", instance.addr()))
        .json(&serde_json::json!({"item_id": 1, "quantity": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
}
