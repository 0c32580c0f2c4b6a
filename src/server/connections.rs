//! Connections: accepted, capped, timed out, and shut down gracefully.
//!
//! The limiter decides per request, so it never sees a client that holds
//! a connection without finishing a request: headers trickled a byte at a
//! time, a body that stalls, an idle keep-alive connection. Each holds a
//! descriptor; enough of them from one host take an instance off the air
//! (the slowloris). `axum::serve` gives hyper no timer, so no header
//! timeout applies, and it has no cap. So this module serves connections
//! itself, with what hyper and hyper-util provide:
//!
//! - **A header timeout** (`http.header_timeout`), hyper's rule with one
//!   timer per connection ([`head_timeout`](super::head_timeout)): the clock starts whenever a
//!   connection begins waiting for a request's head, when it opens and
//!   again when an answer is ready. So one setting closes both a client
//!   that trickles its headers and an idle keep-alive connection.
//! - **A request deadline** (`http.request_timeout`, in
//!   `middleware::Front`): around the whole request once its headers are
//!   in, body reading included; a stalled body is answered 408 and, its
//!   body unread, the connection closed.
//! - **A cap** (`http.max_connections`), and one per client address
//!   (`http.max_connections_per_address`; trusted proxies, as reloaded,
//!   exempt; an IPv6 client counted by its `ipv6_prefix` network). A connection over either
//!   is accepted and closed at once, and counted
//!   (`http_server_connections_refused_total`): the client learns at once
//!   and can try another instance, rather than wait unseen in the kernel's
//!   backlog. The per-address cap is what keeps other clients served while
//!   one host opens more sockets than the whole cap: without it, that host
//!   would hold every slot until its sockets time out.
//! - **413 before the body** (`http.body_limit`, in `middleware::Front`).
//!
//! Graceful shutdown is hyper-util's: idle connections close at once,
//! requests in flight finish.

use super::head_timeout::{HeadClock, HeadTimeout};
use crate::config::HttpConfig;
use crate::limiter::CurrentLimiter;
use crate::metrics as m;
use crate::middleware::Front;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Why a connection was refused: the `reason` label of
/// `http_server_connections_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `http.max_connections` connections were open.
    MaxConnections,
    /// `http.max_connections_per_address` were open from its address.
    MaxPerAddress,
}

impl Refusal {
    /// Every refusal, for metrics registered at zero.
    pub const ALL: [Refusal; 2] = [Refusal::MaxConnections, Refusal::MaxPerAddress];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::MaxConnections => "max_connections",
            Refusal::MaxPerAddress => "max_connections_per_address",
        }
    }
}

/// The open connections, counted in total and per owner address.
#[derive(Debug)]
pub struct Connections {
    max: usize,
    per_address: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// One admitted connection's place under the caps, given back on drop.
#[derive(Debug)]
pub struct Slot {
    connections: Arc<Connections>,
    /// The address it counts against (`None`: a trusted proxy).
    address: Option<IpAddr>,
}

impl Connections {
    /// At most `max` connections, `per_address` from one address.
    pub fn new(max: usize, per_address: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            per_address,
            open: Mutex::new(Open::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // A std mutex: nothing awaits while it is held.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection owned by `address` (see
    /// `Identifier::connection_owner`; `None`, a trusted proxy, counts
    /// only against the total), or why not.
    pub fn admit(self: &Arc<Self>, address: Option<IpAddr>) -> Result<Slot, Refusal> {
        let mut open = self.lock();
        if open.total >= self.max {
            return Err(Refusal::MaxConnections);
        }
        if let Some(address) = address {
            let from = open.by_address.entry(address).or_insert(0);
            if *from >= self.per_address {
                return Err(Refusal::MaxPerAddress);
            }
            *from += 1;
        }
        open.total += 1;
        metrics::gauge!(m::HTTP_SERVER_OPEN_CONNECTIONS).set(open.total as f64);
        Ok(Slot {
            connections: Arc::clone(self),
            address,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().total
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.connections.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(address) = self.address
            && let Some(from) = open.by_address.get_mut(&address)
        {
            *from -= 1;
            if *from == 0 {
                open.by_address.remove(&address);
            }
        }
        metrics::gauge!(m::HTTP_SERVER_OPEN_CONNECTIONS).set(open.total as f64);
    }
}

/// Descriptors an instance needs besides its connections: the listener,
/// Redis connections (one per cluster node, and their reconnections), the
/// runtime's own, logs, the trace exporter's.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// Whether `max_connections` fits under the process's descriptor limit
/// with room to spare; if not, the limit. A cap above it protects nothing:
/// `accept` fails at the limit (and so does everything else that opens a
/// file) before the cap is reached.
pub fn over_descriptor_limit(max_connections: usize) -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let soft = m::process::open_files_limit(&limits)?;
    (max_connections as u64 + RESERVED_DESCRIPTORS > soft).then_some(soft)
}

/// Errors of `accept` that concern one connection, not the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// How long a listener waits after `accept` failed for want of a
/// descriptor or the like, before it tries again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// The next connection on `listener` (`name` in the log). A failure that
/// concerns one connection is skipped. Any other, out of descriptors
/// (EMFILE) above all, is logged and waited out: the pending connections
/// keep the listener readable, so trying again at once would spin a core
/// and log nothing until a descriptor came back.
pub(crate) async fn accept(
    listener: &TcpListener,
    name: &'static str,
) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                tracing::error!(listener = name, error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
}

/// Accepts connections on `listener` and serves `front` on each, within
/// `settings`, until `shutdown` completes; then stops accepting, closes
/// idle connections and waits for requests in flight. Trusted proxies
/// (the limiter's, as reloaded) are exempt from the per-address cap.
pub async fn serve_connections(
    listener: TcpListener,
    front: Front,
    limiter: Arc<CurrentLimiter>,
    settings: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    for reason in Refusal::ALL {
        metrics::counter!(m::HTTP_SERVER_CONNECTIONS_REFUSED_TOTAL, "reason" => reason.as_str())
            .increment(0);
    }
    metrics::counter!(m::HTTP_SERVER_HEADER_TIMEOUTS_TOTAL).increment(0);
    metrics::gauge!(m::HTTP_SERVER_OPEN_CONNECTIONS).set(0.0);
    let connections = Connections::new(
        settings.max_connections,
        settings.max_connections_per_address,
    );
    // No timer for hyper: the header timeout is ours (`HeadTimeout`).
    let http = hyper::server::conn::http1::Builder::new();
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = accept(&listener, "http") => accepted,
            () = &mut shutdown => break,
        };
        let owner = limiter.get().connection_owner(peer.ip());
        let slot = match connections.admit(owner) {
            Ok(slot) => slot,
            Err(refusal) => {
                metrics::counter!(m::HTTP_SERVER_CONNECTIONS_REFUSED_TOTAL, "reason" => refusal.as_str())
                    .increment(1);
                tracing::debug!(%peer, reason = refusal.as_str(), "connection refused");
                // Dropped: closed now, its descriptor freed.
                drop(stream);
                continue;
            }
        };
        // Responses are written whole; Nagle would only delay them.
        let _ = stream.set_nodelay(true);
        let front = front.clone();
        let clock = HeadClock::new(Instant::now());
        let io = HeadTimeout::new(stream, Arc::clone(&clock), settings.header_timeout);
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            clock.answering();
            // Unboxed: hyper keeps the future as its own type.
            let front = front.clone();
            let clock = Arc::clone(&clock);
            let mut request = request.map(Body::new);
            async move {
                // The identity of an anonymous client is its peer address.
                let (response, answered) = front.answer(&mut request, Some(peer.ip())).await;
                clock.waiting_from(answered);
                Ok::<_, Infallible>(response)
            }
        });
        let connection = graceful.watch(http.serve_connection(TokioIo::new(io), service));
        tokio::spawn(async move {
            // A header timeout is counted where it is decided (`HeadTimeout`).
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection closed with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().unwrap())
    }

    #[test]
    fn the_total_and_each_address_are_capped_and_slots_come_back() {
        let c = Connections::new(4, 2);
        let a1 = c.admit(ip("192.0.2.1")).unwrap();
        let _a2 = c.admit(ip("192.0.2.1")).unwrap();
        assert_eq!(
            c.admit(ip("192.0.2.1")).unwrap_err(),
            Refusal::MaxPerAddress
        );
        let _b = c.admit(ip("192.0.2.2")).unwrap();
        // A trusted proxy is not held to the per-address cap...
        let _p = c.admit(None).unwrap();
        assert_eq!(c.open(), 4);
        // ...but everyone is held to the total.
        assert_eq!(c.admit(None).unwrap_err(), Refusal::MaxConnections);
        assert_eq!(
            c.admit(ip("192.0.2.3")).unwrap_err(),
            Refusal::MaxConnections
        );
        drop(a1);
        assert_eq!(c.open(), 3);
        let _a3 = c.admit(ip("192.0.2.1")).unwrap();
        assert_eq!(c.open(), 4);
    }

    #[test]
    fn released_addresses_are_forgotten() {
        let c = Connections::new(10, 1);
        for i in 0..100u8 {
            drop(c.admit(Some(IpAddr::from([10, 0, 0, i]))).unwrap());
        }
        assert_eq!(c.open(), 0);
        assert!(c.lock().by_address.is_empty(), "no entry per past client");
    }
}
