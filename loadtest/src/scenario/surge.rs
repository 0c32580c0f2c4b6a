//! The `hotkey` surge's own client. The surge is nearly every request of
//! a run (8,000 a second against the others' few hundred), and goose spends
//! about 60 µs of CPU on each (runbooks/hot-key.md): on 2 cores the load
//! generator, not the system under test, would be what saturates. So the
//! surge goes out over plain HTTP/1.1 keep-alive connections of hyper's
//! client, one task each, paced by the run's one schedule, each answer
//! checked and counted as goose's users count theirs; goose drives the
//! healthy classes. The connections share one thread and its own
//! single-threaded runtime: an answer then wakes the thread already
//! polling, never a second one.

use super::{Class, Phase, Run, next_request, record};
use crate::traffic::{self, Verdict};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let mut sender: Option<SendRequest<Full<Bytes>>> = None;
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
        let mut request = hyper::Request::builder()
            .method(if route.body().is_some() {
                hyper::Method::POST
            } else {
                hyper::Method::GET
            })
            .uri(route.path())
            .header(hyper::header::HOST, &host)
            .header(hyper::header::USER_AGENT, who.user_agent);
        if let Some(tenant) = key {
            request = request.header("x-api-key", &tenant.key);
        }
        if let Some(addr) = &forwarded_for {
            request = request.header("x-forwarded-for", addr);
        }
        let body = match route.body() {
            Some(json) => {
                request = request.header(hyper::header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(json))
            }
            None => Full::new(Bytes::new()),
        };
        let Ok(request) = request.body(body) else {
            continue;
        };
        let sent = Instant::now();
        let verdict = match tokio::time::timeout(
            TIMEOUT,
            exchange(&mut sender, target, local, request),
        )
        .await
        {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(why)) => {
                sender = None;
                Verdict::Unavailable(format!("transport: {why}"))
            }
            Err(_) => {
                sender = None;
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

/// One request on the client's connection (opened first if it has none)
/// and its answer, read whole and checked.
async fn exchange(
    sender: &mut Option<SendRequest<Full<Bytes>>>,
    target: SocketAddr,
    local: Option<IpAddr>,
    request: hyper::Request<Full<Bytes>>,
) -> Result<Verdict, &'static str> {
    if sender.as_ref().is_none_or(|s| s.is_closed()) {
        *sender = Some(connect(target, local).await?);
    }
    let Some(open) = sender.as_mut() else {
        return Err("connect");
    };
    open.ready().await.map_err(|_| "request")?;
    let response = open.send_request(request).await.map_err(|_| "request")?;
    let status = response.status().as_u16();
    let (parts, body) = response.into_parts();
    body.collect().await.map_err(|_| "body")?;
    Ok(traffic::check(status, &parts.headers))
}

/// A keep-alive HTTP/1.1 connection to `target`, from `local` if given.
async fn connect(
    target: SocketAddr,
    local: Option<IpAddr>,
) -> Result<SendRequest<Full<Bytes>>, &'static str> {
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
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|_| "connect")?;
    tokio::spawn(connection);
    Ok(sender)
}
