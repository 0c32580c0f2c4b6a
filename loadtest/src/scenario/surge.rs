//! The `hotkey` surge's own client. The surge is nearly every request of
//! a run (8,000 a second against the others' few hundred), and goose spends
//! about 60 µs of CPU on each (runbooks/hot-key.md): on 2 cores the load
//! generator, not the system under test, would be what saturates. So the
//! surge goes out over plain HTTP/1.1 keep-alive connections
//! ([`crate::http1`]), one task each, paced by the run's one schedule, each
//! answer checked and counted as goose's users count theirs; goose drives
//! the healthy classes. The connections share one thread and its own
//! single-threaded runtime: an answer then wakes the thread already
//! polling, never a second one.

use super::{Class, Phase, Run, next_request, record};
use crate::http1;
use crate::traffic::{self, Verdict};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::net::SocketAddr;
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
    let mut http = http1::Client::new(target, local, TIMEOUT);
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
        let fields = [
            Some(("host", host.as_str())),
            Some(("user-agent", who.user_agent)),
            key.map(|tenant| ("x-api-key", tenant.key.as_str())),
            forwarded_for
                .as_deref()
                .map(|addr| ("x-forwarded-for", addr)),
        ];
        http1::write_request(
            &mut request,
            if body.is_some() { "POST" } else { "GET" },
            &route.path(),
            fields.into_iter().flatten(),
            body.as_deref(),
        );
        let sent = Instant::now();
        let verdict = http
            .exchange(&request, |status, fields| traffic::check(status, fields))
            .await
            .unwrap_or_else(|why| Verdict::Unavailable(format!("transport: {why}")));
        record(
            &run,
            Class::Surge,
            phase,
            sent.elapsed().as_micros() as u64,
            &verdict,
        );
    }
}
